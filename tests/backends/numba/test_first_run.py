"""A first run compiles the CPU kernels once and says so; a later process loads them from
numba's on-disk cache, silently (issue 23: time to first result)."""

import subprocess
import sys

SCRIPT = """
import time, torch, fastrwa
z, a = torch.randn(1, 8, 4), torch.randn(1, 8, 4)
began = time.perf_counter()
fastrwa.rwa_scan(z, a)
print(f"first call {time.perf_counter() - began:.2f} s")
"""


def test_the_first_process_says_it_compiles_and_the_next_loads(tmp_path):
    env = {**__import__("os").environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                           env=env, check=True) for _ in range(2)]
    notice = "fastrwa: compiling CPU kernels (first run only"
    assert notice in runs[0].stderr, runs[0].stderr
    assert notice not in runs[1].stderr, runs[1].stderr
    assert any(tmp_path.rglob("*.nbi")), "nothing was cached"
