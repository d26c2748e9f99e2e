"""The benchmarks' protocol and gate: every suite declares its sides and
settings, the command line takes each suite's own defaults, and
`python -m benchmarks compare` judges medians and spreads."""

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

from benchmarks.gate import compare_summaries  # noqa: E402


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
    from benchmarks.suites.payload import LAYERS, MODEL, prompt_tokens

    tokens = prompt_tokens(256)
    assert tokens * len(LAYERS) * MODEL["hidden_size"] * 2 == 256 << 20


def test_payload_health_windows_take_the_longest_answer_inside() -> None:
    from benchmarks.suites.payload import health_windows

    samples = [(0.5, 0.010), (1.0, 0.020), (1.5, 0.300), (2.5, 0.040), (9.0, 1.0)]
    got = health_windows(samples, [(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)])
    assert got[:2] == [300.0, 40.0]
    assert got[2] != got[2]  # no answer in the window: NaN, not 0


def test_every_suite_declares_sides_and_settings_with_defaults() -> None:
    from benchmarks.protocol import shared_options
    from benchmarks.suites import DEFAULT_SUITES, SUITES

    shared_options(SUITES.values())  # one meaning per option name
    assert set(DEFAULT_SUITES) <= set(SUITES)
    for name, suite in SUITES.items():
        assert suite.name == name and len(suite.sides) >= 2, name
        assert suite.options(), name
        suite.resolve({})  # its own defaults


def test_options_left_out_keep_each_suites_default() -> None:
    from benchmarks.suites import SUITES

    given = {"rounds": None, "size_mib": 8, "quick": True, "prompts": 3}
    payload = SUITES["payload"].resolve(given)
    assert (payload.size_mib, payload.rounds) == (8, 2)  # --quick: 2 rounds
    capture = SUITES["capture"].resolve(given)
    assert (capture.rounds, capture.prompts, capture.eager) == (4, 3, True)
    assert SUITES["extraction"].resolve({"eager": False}).eager is False
    assert SUITES["response_encoding"].resolve({"quick": True}).rows == [16, 256]


def test_command_line_options_reach_the_suites() -> None:
    import argparse

    from benchmarks.__main__ import add_suite_options

    parser = argparse.ArgumentParser()
    add_suite_options(parser)
    args = parser.parse_args(["--compile", "--rows", "16,64", "--rounds", "2"])
    assert (args.eager, args.rows, args.rounds, args.quick) == (
        False,
        [16, 64],
        2,
        None,
    )


def test_unknown_suite_is_refused() -> None:
    from benchmarks.__main__ import main

    assert main(["run", "no_such_suite"]) == 2


def test_rounds_rotate_their_sides() -> None:
    from benchmarks.rounds import alternate, rotation, run_rounds

    assert [rotation("abc", r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"],
    ]  # fmt: skip
    calls: list[str] = []
    sides = {s: (lambda s=s: calls.append(s) or s) for s in ("A", "B")}
    assert [list(r) for r in run_rounds(2, sides)] == [["A", "B"], ["B", "A"]]
    assert [list(r) for r in run_rounds(2, sides, rotate=False)] == [["A", "B"]] * 2
    rounds = alternate(2, lambda: {"v": 1.0}, lambda: {"v": 2.0}, lambda a, b: 2.0)
    assert [r["ratio"] for r in rounds] == [2.0, 2.0] and rounds[1]["round"] == 1


def test_result_file_shape() -> None:
    from benchmarks.result import Result, summarize

    data = Result("x", "d", {}, [], None, extra={"cases": [1]}).to_json()
    assert "summary" not in data and data["cases"] == [1] and "extra" not in data
    data = Result("x", "d", {}, [], summarize([1.0, 3.0], "m", True, None)).to_json()
    assert data["summary"]["median"] == 2.0


def test_report_regenerates_from_the_committed_results(tmp_path: Path) -> None:
    import shutil

    from benchmarks.report import write_report

    results = REPO / "benchmarks" / "results"
    shutil.copytree(results, tmp_path / "results")
    write_report(tmp_path / "results")
    chart = "\n![ratios by suite and release](chart.png)\n"  # with matplotlib

    def table(path: Path) -> str:
        return path.read_text().replace(chart, "")

    assert table(tmp_path / "results" / "README.md") == table(results / "README.md")


def test_benchmarks_run_as_modules_without_path_hacks() -> None:
    for path in (REPO / "benchmarks").rglob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path
        assert len(text.splitlines()) <= 500, path
