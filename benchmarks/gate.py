"""The release gate: is a suite's new figure worse than its old one?"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def compare_summaries(
    old: dict[str, Any], new: dict[str, Any], threshold: float
) -> tuple[str, float]:
    """The gate's verdict on two suite summaries ({median, min, max,
    higher_is_better}) and the relative change of the median (positive: better).

    "worse" needs both: the median lost more than `threshold`, and the new
    median lies outside the old run's [min, max] on the losing side (a drop
    that the old run's own spread covers is noise on these machines, not a
    regression). "noisy": the median lost more than `threshold` but within the
    old spread; rerun with more rounds before trusting it. "ok" otherwise.
    """
    o, n = old["median"], new["median"]
    higher = new["higher_is_better"]
    change = (n - o) / o if higher else (o - n) / o
    if change >= -threshold:
        return "ok", change
    outside = n < old["min"] if higher else n > old["max"]
    return ("worse" if outside else "noisy"), change


def compare_files(old_path: Path, new_path: Path, threshold: float) -> int:
    """Print the verdict on two result files; exit status 1 when worse, 2
    when they are of different suites."""
    old = json.loads(old_path.read_text())
    new = json.loads(new_path.read_text())
    if old["suite"] != new["suite"]:
        print(f"different suites: {old['suite']} vs {new['suite']}", file=sys.stderr)
        return 2
    o, n = old["summary"], new["summary"]
    verdict, change = compare_summaries(o, n, threshold)
    print(
        f"{new['suite']}: {n['metric']}: {o['median']:.4f} [{o['min']:.4f}, "
        f"{o['max']:.4f}] -> {n['median']:.4f} [{n['min']:.4f}, {n['max']:.4f}] "
        f"({change:+.1%}, threshold -{threshold:.0%}): {verdict}"
    )
    return 1 if verdict == "worse" else 0
