"""Shared machinery of the regression benchmarks: alternating A/B rounds,
ratio statistics, machine facts and result files.

Every figure is a ratio measured in one run: the two sides alternate (A B A B
...) for several rounds, so slow drifts of a noisy machine hit both sides; the
result keeps every round and reports the median with min and max.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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
class SuiteResult:
    suite: str
    description: str
    settings: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: Summary
    memory: dict[str, Any] = field(default_factory=dict)
    """Peak RSS per process role and side (memory_summary), where measured."""
    machine: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    started: str = ""
    seconds: float = 0.0
    load_average: dict[str, Any] = field(default_factory=dict)
    """1/5/15-minute load averages before and after: other work on the machine."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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


def alternate(
    rounds: int,
    side_a: Callable[[], dict[str, Any]],
    side_b: Callable[[], dict[str, Any]],
    ratio: Callable[[dict[str, Any], dict[str, Any]], float],
) -> list[dict[str, Any]]:
    """Run A then B, `rounds` times (B first on odd rounds, so neither side
    always runs warm or cold); return every round with its ratio."""
    results = []
    for r in range(rounds):
        if r % 2 == 0:
            a = side_a()
            b = side_b()
        else:
            b = side_b()
            a = side_a()
        results.append({"round": r, "A": a, "B": b, "ratio": ratio(a, b)})
        print(f"  round {r}: ratio {results[-1]['ratio']:.4f}", flush=True)
    return results


MEMORY_KEYS = {
    "frontend": "peak_rss_frontend",
    "engine_core": "peak_rss_engine_core",
    "workers": "peak_rss_workers",
    "engine": "peak_rss_engine",
    "total": "peak_rss_total",
}
"""Peak-RSS roles of a timing record (benchmarks.workload.PeakRss): the frontend
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


def machine_facts() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import psutil

        facts["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return facts


def installed_versions(python: str = sys.executable) -> dict[str, Any]:
    """vLLM version and vllm-hs series of the vllm importable by `python`,
    read without importing vllm (vllm-hs status --json)."""
    code = (
        "import json; from vllm_hs.series.status import installed_status, status_dict; "
        "print(json.dumps(status_dict(installed_status())))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        ).stdout
        return json.loads(out)
    except (subprocess.SubprocessError, json.JSONDecodeError, OSError) as e:
        return {"error": str(e)}


def has_channel(python: str) -> bool:
    """Whether the vllm importable by `python` has the hidden-state channel."""
    try:
        subprocess.run(
            [python, "-c", "import vllm; vllm.HiddenStatesParams"],
            capture_output=True,
            check=True,
            timeout=120,
        )
        return True
    except (subprocess.SubprocessError, OSError):
        return False


def vllm_release(versions: dict[str, Any]) -> str:
    version = str(versions.get("vllm_version") or "unknown")
    return "v" + version.split("+", 1)[0]


def write_result(
    result: SuiteResult, release: str, out_root: Path | None = None
) -> Path:
    directory = (out_root or RESULTS_ROOT) / release
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.suite}.json"
    path.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")
    return path


def write_script_result(data: dict[str, Any], out: Path | None = None) -> Path:
    """Write a standalone script's result (``data["suite"]`` names it) to
    ``out``, or to results/v<the importable vLLM's release>/<suite>.json."""
    if out is None:
        import vllm

        release = "v" + vllm.__version__.split("+", 1)[0]
        out = RESULTS_ROOT / release / f"{data['suite']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
