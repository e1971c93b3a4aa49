"""The report's verdict against a task's naive baseline has a margin (issue 59): parity at
0.507 accuracy is at chance, not a win."""

import math

import pytest

from fastrwa.train.verdict import binomial_tail, verdict


def test_the_binomial_tail_is_the_sum_of_the_probabilities():
    n, p = 12, 0.3
    exact = [math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)]
    assert binomial_tail(5, n, p, upper=True) == pytest.approx(sum(exact[5:]), rel=1e-12)
    assert binomial_tail(5, n, p, upper=False) == pytest.approx(sum(exact[:6]), rel=1e-12)


@pytest.mark.parametrize("value, scored, words", [
    (0.507, 1000, "at chance"),         # 507 of 1000: P(X >= 507) = 0.34 at p = 0.5
    (0.507, 100_000, "beats it"),       # the same rate over 100,000: 4.4 standard deviations
    (0.6, 1000, "beats it"),
    (0.45, 1000, "does not beat it"),
])
def test_an_accuracy_beats_chance_only_beyond_the_binomial_noise(value, scored, words):
    assert verdict(value, 0.5, True, scored=scored).startswith(words)


@pytest.mark.parametrize("value, se, batches, words", [
    (0.160, 0.004, 100, "at chance"),   # 0.0067 below 1/6: 1.7 standard errors
    (0.100, 0.004, 100, "beats it"),    # 17 standard errors
    (0.200, 0.004, 100, "does not beat it"),
    (0.150, 0.004, 100, "beats it"),    # 4.2 standard errors: beyond t(99) = 2.66
    (0.150, 0.004, 4, "at chance"),     # ... within t(3) = 5.84: four batches say little
    (0.150, 0.004, 1, "beats it (one evaluation batch"),
])
def test_a_mean_beats_its_baseline_only_beyond_its_standard_error(value, se, batches, words):
    assert verdict(value, 1 / 6, False, se=se, batches=batches).startswith(words)


def test_a_diverged_metric_does_not_beat_the_baseline():
    assert verdict(float("nan"), 1 / 6, False, se=float("nan"), batches=4).startswith(
        "does not beat it")


def test_the_report_says_at_chance_for_a_run_within_the_noise(tmp_path, monkeypatch, capsys):
    """A parity run whose accuracy is within the binomial noise of 0.5 is reported at
    chance (it was 'beats it' for any value above 0.5)."""
    from fastrwa.train import cli
    from fastrwa.train.problems import SyntheticProblem

    evaluate = SyntheticProblem.evaluate

    def near_chance(self, *args, **kwargs):
        record = evaluate(self, *args, **kwargs)
        return {**record, "accuracy": 0.5 + 1 / record["scored"]}
    monkeypatch.setattr(SyntheticProblem, "evaluate", near_chance)
    assert cli.main(["--task", "parity", "--seq-len", "10", "--hidden", "4", "--batch-size",
                     "8", "--steps", "2", "--no-progress", "--run-dir",
                     str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "parity: valid accuracy" in out and ": at chance" in out, out
    assert "beats it" not in out
