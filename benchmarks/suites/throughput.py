"""Plain generation on two engines in separate processes, run alternately:
the patched wheel against the unpatched one (overhead, overhead_config), and
Model Runner V2 against V1 (runner)."""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.result import Result, summarize
from benchmarks.rounds import alternate
from benchmarks.suites.engine import (
    EngineSettings,
    engine_kwargs,
    engine_result,
    four_layers,
    model_dir,
    run_workload,
    workload_spec,
)

Side = tuple[str, str, dict[str, Any]]  # (label, python, workload spec)


def _throughput_side(python: str, spec: dict[str, Any]) -> dict[str, Any]:
    runs = run_workload(python, spec)["timings"]["plain"]
    best = max(runs, key=lambda t: t["tokens_per_s"])
    return {
        "runs": runs,
        "tokens_per_s": best["tokens_per_s"],
        "peak_rss_total": max(t["peak_rss_total"] for t in runs),
    }


def _alternating_throughput(
    settings: EngineSettings,
    name: str,
    description: str,
    metric: str,
    aim: float,
    a: Side,
    b: Side,
) -> Result:
    """Plain generation on side `a` against side `b`, each in its own processes,
    run alternately: throughput ratio b / a per round, and peak-memory ratios."""
    rounds = alternate(
        settings.rounds,
        lambda: _throughput_side(a[1], a[2]),
        lambda: _throughput_side(b[1], b[2]),
        lambda x, y: y["tokens_per_s"] / x["tokens_per_s"],
    )
    for r in rounds:
        r["memory_ratio"] = r["B"]["peak_rss_total"] / r["A"]["peak_rss_total"]
    summary = summarize([r["ratio"] for r in rounds], metric, True, aim)
    return engine_result(
        name,
        description,
        settings,
        rounds,
        summary,
        memory={
            a[0]: [t for r in rounds for t in r["A"]["runs"]],
            b[0]: [t for r in rounds for t in r["B"]["runs"]],
        },
    )


def _overhead(settings: EngineSettings, name: str, with_config: bool) -> list[Result]:
    if not settings.unpatched_python:
        print(f"{name}: skipped (no --unpatched-python given)")
        return []
    path, sizes = model_dir(settings)
    layers = four_layers(sizes) if with_config else None
    unpatched = workload_spec(settings, path, sizes, rounds=2)
    patched = workload_spec(
        settings, path, sizes, rounds=2, engine=engine_kwargs(settings, layers)
    )
    what = (
        f"hidden_states_config with {len(layers)} layers"
        if layers
        else "no hidden_states_config"
    )
    result = _alternating_throughput(
        settings,
        name,
        f"patched engine ({what}), requests asking nothing, against the "
        "unpatched wheel of the same release (separate processes, alternating); "
        "rounds also record peak-memory ratios",
        f"throughput patched ({what}, no request asking) / unpatched",
        0.99,
        ("unpatched", settings.unpatched_python, unpatched),
        ("patched", sys.executable, patched),
    )
    return [result]


def overhead(settings: EngineSettings) -> list[Result]:
    """The patched wheel as a drop-in: no hidden_states_config."""
    return _overhead(settings, "overhead", with_config=False)


def overhead_config(settings: EngineSettings) -> list[Result]:
    """An engine started with the channel, serving requests that ask nothing:
    the model emits aux hidden states every step (the compiled graph's outputs
    are fixed at start), so this is the channel's standing cost."""
    return _overhead(settings, "overhead_config", with_config=True)


def runner(settings: EngineSettings) -> list[Result]:
    """Plain generation (no hidden_states_config) on Model Runner V2 without
    Triton (the series' torch kernels on CPU) against Model Runner V1, the
    same patched wheel, separate processes run alternately."""
    path, sizes = model_dir(settings)

    def spec(flag: str) -> dict[str, Any]:
        return {
            **workload_spec(settings, path, sizes, rounds=2),
            "env": {"VLLM_USE_V2_MODEL_RUNNER": flag},
        }

    result = _alternating_throughput(
        settings,
        "runner",
        "plain generation on Model Runner V2 without Triton (torch kernels) "
        "against Model Runner V1, same patched wheel, separate processes "
        "alternating",
        "throughput Model Runner V2 (no Triton) / Model Runner V1",
        1 / 1.3,
        ("v1", sys.executable, spec("0")),
        ("v2", sys.executable, spec("1")),
    )
    return [result]
