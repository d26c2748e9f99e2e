"""The one runner of every suite: settings from the command line, the
importable vLLM checked and its versions read, each suite measured with the
machine's load before and after, results stamped (machine, versions, time),
written to results/<vLLM release>/<suite>.json, and the report regenerated."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import (
    has_channel,
    installed_versions,
    machine_facts,
    now,
    vllm_release,
)
from benchmarks.protocol import Suite
from benchmarks.result import RESULTS_ROOT, Result, write_result


def patched_versions(unpatched_python: str | None) -> dict[str, Any] | None:
    """Versions of the importable (patched) vLLM, and of the unpatched one
    when given; None when the importable vLLM is not patched."""
    versions = installed_versions()
    if not versions.get("patched") and has_channel(sys.executable):
        versions["patched"] = "unmarked development tree (no vllm-hs marker)"
    if not versions.get("patched"):
        print(f"the importable vllm is not patched: {versions}", file=sys.stderr)
        return None
    if unpatched_python:
        versions["unpatched"] = installed_versions(unpatched_python)
    return versions


def run_suites(
    suites: list[Suite], given: dict[str, Any], out: Path | None, write: bool
) -> int:
    """Measure `suites` with the options `given` (None: each suite's own
    default); write their results under `out` (default RESULTS_ROOT) and the
    report, unless not `write`. Exit status: 2 when vLLM is not patched."""
    versions = patched_versions(given.get("unpatched_python"))
    if versions is None:
        return 2
    release = vllm_release(versions)
    machine = machine_facts()
    for suite in suites:
        settings = suite.resolve(given)
        model = getattr(settings, "model", None)
        shown = "" if model is None else f", model {model}"
        print(f"== {suite.name} ({release}{shown})", flush=True)
        load_before = os.getloadavg()
        started = now()
        t0 = time.perf_counter()
        results = suite.measure(settings)
        seconds = time.perf_counter() - t0
        load_after = os.getloadavg()
        for result in results:
            stamp(result, machine, versions, started, seconds)
            result.load_average = {"before": load_before, "after": load_after}
            where = f" -> {write_result(result, release, out)}" if write else ""
            s = result.summary
            figure = (
                "no figure"
                if s is None
                else f"{s.metric}: median {s.median:.4f} [min {s.min:.4f}, "
                f"max {s.max:.4f}]"
            )
            print(f"{result.suite}: {figure}{where}", flush=True)
    if write:
        from benchmarks.report import write_report

        write_report(out or RESULTS_ROOT)
    return 0


def stamp(
    result: Result,
    machine: dict[str, Any],
    versions: dict[str, Any],
    started: str,
    seconds: float,
) -> None:
    """What every result records beside its rounds; a suite's own machine
    and version facts are kept (added to the common ones)."""
    result.machine = {**machine, **result.machine}
    result.versions = {**versions, **result.versions}
    result.started = started
    result.seconds = seconds
