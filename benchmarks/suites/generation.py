"""Batches with hidden states against the same batches without, alternating
on one patched engine: capture (prompt and output states), decode (output
states in a decode-heavy batch) and probe (each prompt's last position)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from benchmarks.result import Result, summarize
from benchmarks.suites.engine import (
    EngineSettings,
    engine_kwargs,
    engine_result,
    four_layers,
    model_dir,
    run_workload,
    workload_spec,
)


def capture(settings: EngineSettings) -> list[Result]:
    return _generation(
        settings,
        "capture",
        {"prompt": True, "output": True},
        "prompt+output",
        "generation with hidden states against without, one patched engine, "
        "batches alternating; rounds record peak RSS per process (frontend, "
        "engine core, worker)",
    )


# The decode suite's batch: short prompts, long generations, so that decode
# steps (one row per request and step) are most of the time.
DECODE_SHAPE = {"prompts": 64, "prompt_len": 16, "max_tokens": 256}


def decode(settings: EngineSettings) -> list[Result]:
    """Generation with output states only, in a decode-heavy batch
    (DECODE_SHAPE, whatever --prompts/--prompt-len/--max-tokens say): the
    channel's cost per request and decode step, which `capture`'s long
    prompts hide."""
    return _generation(
        dataclasses.replace(settings, **DECODE_SHAPE),
        "decode",
        {"prompt": False, "output": True},
        "output",
        "decode-heavy generation (64 prompts of 16 tokens, 256 tokens each) "
        "with output states against without, one patched engine, batches "
        "alternating: the per-request, per-step cost of the channel",
    )


def _generation(
    settings: EngineSettings,
    name: str,
    states: dict[str, Any],
    kinds: str,
    description: str,
) -> list[Result]:
    path, sizes = model_dir(settings)
    layers = four_layers(sizes)
    spec = workload_spec(
        settings,
        path,
        sizes,
        rounds=settings.rounds,
        variants={"plain": None, "states": states},
        engine=engine_kwargs(settings, layers),
    )
    out = run_workload(sys.executable, spec)["timings"]
    rounds = []
    for r, (a, b) in enumerate(zip(out["plain"], out["states"], strict=True)):
        rounds.append(
            {
                "round": r,
                "A": a,
                "B": b,
                "ratio": b["tokens_per_s"] / a["tokens_per_s"],
                "memory_ratio": b["peak_rss_total"] / a["peak_rss_total"],
            }
        )
        print(f"  round {r}: ratio {rounds[-1]['ratio']:.4f}", flush=True)
    summary = summarize(
        [r["ratio"] for r in rounds],
        f"throughput with states ({len(layers)} layers, {kinds}) / without",
        True,
        0.97,
    )
    result = engine_result(
        name,
        description,
        settings,
        rounds,
        summary,
        memory={"without states": out["plain"], "with states": out["states"]},
    )
    return [result]


def probe(settings: EngineSettings) -> list[Result]:
    """A last-token probe: prefill only, the states of each prompt's last
    position (`positions="last"`), against the same batch without states and
    with every prompt row (what a probe had to ask for before positions),
    batches alternating on one engine. Rounds record the bytes each side
    delivered and its wall time."""
    path, sizes = model_dir(settings)
    layers = four_layers(sizes)
    spec = workload_spec(
        settings,
        path,
        sizes,
        rounds=settings.rounds,
        max_tokens=1,
        variants={
            "plain": None,
            "all_rows": {"prompt": True, "output": False},
            "last": {"prompt": True, "output": False, "positions": "last"},
        },
        engine=engine_kwargs(settings, layers),
        peak_rss=False,
    )
    out = run_workload(sys.executable, spec)["timings"]
    rounds = []
    for r, (plain, every, last) in enumerate(
        zip(out["plain"], out["all_rows"], out["last"], strict=True)
    ):
        rounds.append(
            {
                "round": r,
                "A": plain,
                "B": last,
                "all_rows": every,
                "ratio": last["tokens_per_s"] / plain["tokens_per_s"],
                "all_rows_ratio": every["tokens_per_s"] / plain["tokens_per_s"],
                "last_over_all_rows": last["tokens_per_s"] / every["tokens_per_s"],
                "bytes_last": last["state_bytes"],
                "bytes_all_rows": every["state_bytes"],
            }
        )
        print(
            f"  round {r}: last/plain {rounds[-1]['ratio']:.4f} "
            f"({last['state_bytes']} B), all rows/plain "
            f"{rounds[-1]['all_rows_ratio']:.4f} ({every['state_bytes']} B)",
            flush=True,
        )
    result = engine_result(
        "probe",
        probe.__doc__ or "",
        settings,
        rounds,
        summarize(
            [r["ratio"] for r in rounds],
            f"throughput with last-position states ({len(layers)} layers, prefill) "
            "/ without",
            True,
            0.97,
        ),
        max_tokens=1,
        layers=layers,
    )
    return [result]
