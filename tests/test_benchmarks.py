"""The benchmark gate (`python -m benchmarks compare`): medians and spreads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# `benchmarks` is not installed: appended (not prepended) so that vllm_hs still
# comes from the installed wheel under tox.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks.__main__ import compare_summaries  # noqa: E402


def summary(median: float, low: float, high: float, higher: bool = True) -> dict:
    return {"median": median, "min": low, "max": high, "higher_is_better": higher}


@pytest.mark.parametrize(
    ("old", "new", "verdict"),
    [
        (summary(1.00, 0.98, 1.02), summary(0.99, 0.97, 1.01), "ok"),
        (summary(1.00, 0.98, 1.02), summary(1.30, 1.20, 1.40), "ok"),
        # A 10% drop the old spread covers: noise, not a regression.
        (summary(1.00, 0.80, 1.20), summary(0.90, 0.70, 1.10), "noisy"),
        # A 10% drop below everything the old run measured.
        (summary(1.00, 0.98, 1.02), summary(0.90, 0.88, 0.92), "worse"),
        # Lower is better: the same rules mirrored.
        (summary(1.00, 0.98, 1.02, False), summary(1.10, 1.08, 1.12, False), "worse"),
        (summary(1.00, 0.80, 1.20, False), summary(1.10, 1.00, 1.20, False), "noisy"),
        (summary(1.00, 0.98, 1.02, False), summary(0.90, 0.88, 0.92, False), "ok"),
    ],
)
def test_verdicts(old: dict, new: dict, verdict: str) -> None:
    assert compare_summaries(old, new, threshold=0.05)[0] == verdict


def test_compare_command_exit_status(tmp_path: Path) -> None:
    def write(name: str, s: dict) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"suite": "x", "summary": {**s, "metric": "m"}}))
        return path

    old = write("old.json", summary(1.00, 0.85, 1.02))
    for new, status in (
        (write("same.json", summary(1.00, 0.99, 1.01)), 0),
        (write("noisy.json", summary(0.90, 0.70, 1.00)), 0),
        (write("worse.json", summary(0.80, 0.78, 0.82)), 1),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks", "compare", str(old), str(new)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert result.returncode == status, result.stdout + result.stderr


def test_payload_prompt_is_the_asked_size() -> None:
    from benchmarks.payload import LAYERS, MODEL, prompt_tokens

    tokens = prompt_tokens(256)
    assert tokens * len(LAYERS) * MODEL["hidden_size"] * 2 == 256 << 20


def test_payload_health_windows_take_the_longest_answer_inside() -> None:
    from benchmarks.payload import health_windows

    samples = [(0.5, 0.010), (1.0, 0.020), (1.5, 0.300), (2.5, 0.040), (9.0, 1.0)]
    got = health_windows(samples, [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)])
    assert got[:2] == [300.0, 40.0]
    assert got[2] != got[2]  # no answer in the window: NaN, not 0
