"""``python -m fastrwa.demo``: every op it lists is checked against the reference."""

import subprocess
import sys


def test_demo_checks_every_op_and_passes():
    out = subprocess.run([sys.executable, "-m", "fastrwa.demo", "--length", "96",
                          "--channels", "8"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for name in ("rwa_scan", "rda_scan attention=exp", "rda_scan attention=relu",
                 "weighted_scan (log decay)", "rda_scan gradients",
                 "prefill + 64 rda_step vs reference"):
        assert any(line.strip().startswith(name) and " ok" in line for line in lines), name
    assert lines[-1] == "all checks passed"
