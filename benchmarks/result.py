"""A suite's result: its figure (a ratio over rounds: median, min, max), every
round, and the file it is kept in (results/<vLLM release>/<suite>.json, the
shape `benchmarks.report` reads)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_ROOT = Path(__file__).resolve().parent / "results"


@dataclass
class Summary:
    metric: str
    """What the ratio is, e.g. 'throughput with states / without'."""
    higher_is_better: bool
    aim: float | None
    median: float
    min: float
    max: float


@dataclass
class Result:
    suite: str
    """The result file's name (a suite may give several figures)."""
    description: str
    settings: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: Summary | None
    """The figure of the generated table; None: no figure (the file is kept,
    the table leaves it out)."""
    memory: dict[str, Any] = field(default_factory=dict)
    """Peak RSS per process role and side (memory_summary), where measured."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Suite-specific top-level keys of the file (comparisons, figures...)."""
    machine: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    started: str = ""
    seconds: float = 0.0
    load_average: dict[str, Any] = field(default_factory=dict)
    """1/5/15-minute load averages before and after: other work on the machine."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        if data["summary"] is None:
            del data["summary"]
        return data


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of a figure over rounds (or batches)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def summarize(
    ratios: list[float], metric: str, higher_is_better: bool, aim: float | None
) -> Summary:
    return Summary(
        metric=metric, higher_is_better=higher_is_better, aim=aim, **spread(ratios)
    )


MEMORY_KEYS = {
    "frontend": "peak_rss_frontend",
    "engine_core": "peak_rss_engine_core",
    "workers": "peak_rss_workers",
    "engine": "peak_rss_engine",
    "total": "peak_rss_total",
}
"""Peak-RSS roles of a timing record (benchmarks.peak_rss.PeakRss): the frontend
(the caller's process), vLLM's engine-core process, its executor worker(s) (the
multiprocess executor runs the model in a child of the engine core), the engine
side as a whole (sampled simultaneous sum of every child) and everything."""


def memory_summary(sides: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per side and role: peak RSS in MiB, median [min, max] over the side's
    measured batches (each batch's peak is the process's high-water mark over
    that batch)."""
    out: dict[str, Any] = {}
    for side, runs in sides.items():
        roles = {}
        for role, key in MEMORY_KEYS.items():
            values = [r[key] / 2**20 for r in runs if r.get(key)]
            if values:
                roles[role] = spread(values)
        methods = {r.get("peak_rss_method", "sampled") for r in runs}
        out[side] = {"mib": roles, "method": "+".join(sorted(methods)), "n": len(runs)}
    return out


def write_result(result: Result, release: str, root: Path | None = None) -> Path:
    """results/<release>/<suite>.json under `root` (default: RESULTS_ROOT)."""
    directory = (root or RESULTS_ROOT) / release
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.suite}.json"
    path.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return path
