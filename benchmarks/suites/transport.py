"""Prefill with every layer's states of every prompt token against the same
batch without: what the channel's transport costs per byte (transport), in
throughput (heavy_payload), and in the engine core's memory under one long
request (memory)."""

from __future__ import annotations

import dataclasses
import sys

from benchmarks.result import Result, summarize
from benchmarks.suites.engine import (
    MODELS,
    EngineSettings,
    dtype_bytes,
    engine_kwargs,
    engine_result,
    model_dir,
    run_workload,
    seeded_model,
    workload_spec,
)

TRANSPORT_MIN_ROUNDS = 21
"""transport's figure is the difference of two noisy wall times: it takes at
least this many rounds (batches alternate within one engine: cheap), and runs
without the peak-memory sampler."""
TRANSPORT_CAP = 100.0
"""The transport figure of a round whose states side added no measurable wall
time (noise made it as fast as plain, or faster): 100x memcpy, a cap that keeps
the figure finite and ordered."""


def transport(settings: EngineSettings) -> list[Result]:
    """Prefill only, every layer (0..L) of every prompt token, against the same
    batch without states, on one multiprocess engine, alternating batch by
    batch. Two figures from the same rounds:

    - transport: the wall time the states add, per byte delivered, as an
      effective bandwidth against this machine's memcpy (state bytes / (wall
      with states - wall without), over memcpy bytes/s measured in the same
      process): what the channel's hops (the worker's gather and copy to the
      host, its buffer of a prompt's rows until they are complete, worker to
      engine core, engine core to frontend, the output's tensor) cost beyond a
      single copy of the payload. The forward pass is on both sides and
      cancels out. For scale, the same run times one ZeroMQ IPC hop of the
      same bytes between two processes (`ipc_hop_s`): vLLM's process
      boundaries are two such hops (worker to engine core, engine core to
      frontend); each round also records the extra time beyond two hops.
    - heavy_payload: throughput with all L+1 layers requested / without states.
    """
    settings = dataclasses.replace(
        settings, rounds=max(settings.rounds, TRANSPORT_MIN_ROUNDS)
    )
    path, sizes = model_dir(settings)
    num_layers = sizes.get("num_hidden_layers", 4)
    layers = list(range(num_layers + 1))
    spec = workload_spec(
        settings,
        path,
        sizes,
        rounds=settings.rounds,
        max_tokens=1,
        variants={"plain": None, "states": {"prompt": True, "output": False}},
        engine=engine_kwargs(settings, layers),
        memcpy_mib=512,
        # The states of one batch: every layer of every prompt token.
        ipc_hop=settings.prompts
        * settings.prompt_len
        * len(layers)
        * sizes.get("hidden_size", 128)
        * dtype_bytes(settings.dtype),
        peak_rss=False,
    )
    spec["mode"] = "mp"
    out = run_workload(sys.executable, spec)
    bandwidth = out["memcpy_bytes_per_s"]
    hop_s = out["ipc_hop_s"]
    rounds = []
    for r, (a, b) in enumerate(
        zip(out["timings"]["plain"], out["timings"]["states"], strict=True)
    ):
        extra_s = b["wall_s"] - a["wall_s"]
        memcpy_s = b["state_bytes"] / bandwidth
        share = (
            TRANSPORT_CAP if extra_s <= 0 else min(memcpy_s / extra_s, TRANSPORT_CAP)
        )
        rounds.append(
            {
                "round": r,
                "A": a,
                "B": b,
                "extra_s": extra_s,
                "memcpy_s": memcpy_s,
                "memcpy_bytes_per_s": bandwidth,
                "ipc_hop_s": hop_s,
                "beyond_two_hops_s": extra_s - 2 * hop_s,
                "effective_bytes_per_s": b["state_bytes"] / extra_s
                if extra_s > 0
                else None,
                "ratio": share,
                "throughput_ratio": b["tokens_per_s"] / a["tokens_per_s"],
            }
        )
        print(
            f"  round {r}: +{extra_s * 1e3:.1f} ms for {b['state_bytes'] / 2**20:.1f} "
            f"MiB (memcpy {memcpy_s * 1e3:.1f} ms, one IPC hop "
            f"{hop_s * 1e3:.1f} ms): {share:.4f} of memcpy; "
            f"throughput {rounds[-1]['throughput_ratio']:.4f}",
            flush=True,
        )
    what = f"all {len(layers)} layers, prefill"
    transport_result = engine_result(
        "transport",
        (transport.__doc__ or "") + f"\n\nA round where the states side was not "
        f"slower counts as {TRANSPORT_CAP:g} (the cap).",
        settings,
        rounds,
        summarize(
            [r["ratio"] for r in rounds],
            f"effective bytes/s of the states ({what}: bytes / wall time they add) "
            "/ memcpy bytes/s",
            True,
            0.25,
        ),
        max_tokens=1,
        layers=layers,
        ipc_hop_s=hop_s,
        memcpy_bytes_per_s=bandwidth,
    )
    heavy = engine_result(
        "heavy_payload",
        "throughput (tokens/s) of prefill with every layer's states of every prompt "
        "token against the same batch without states; same rounds as transport",
        settings,
        [{**r, "ratio": r["throughput_ratio"]} for r in rounds],
        summarize(
            [r["throughput_ratio"] for r in rounds],
            f"throughput with states ({what}) / without",
            True,
            0.9,
        ),
        max_tokens=1,
        layers=layers,
    )
    return [transport_result, heavy]


LONG_PROMPT = 8192  # tokens of the memory suite's request (at least)


def memory(settings: EngineSettings) -> list[Result]:
    """One long prompt-states request (all L+1 layers, prefill only) against the
    same request without states, alternating on one multiprocess engine whose
    per-request cap is 1.25x that request's rows: how much the engine core's
    peak resident memory grows, against its bound. The engine core holds a
    request's prompt rows once (at most the cap) plus the rows of the step in
    flight (at most max_num_batched_tokens rows, received from the worker
    before they are folded in): the bound is their sum."""
    prompt_len = max(settings.prompt_len, LONG_PROMPT)
    path, sizes = model_dir(settings)
    if settings.model in MODELS:
        # The seeded model with room for the long prompt (same weights).
        path = seeded_model(settings.model, max_position_embeddings=prompt_len + 64)
    num_layers = sizes.get("num_hidden_layers", 4)
    layers = list(range(num_layers + 1))
    hidden = sizes.get("hidden_size", 128)  # 128: the tiny model's default
    row_bytes = prompt_len * len(layers) * hidden * dtype_bytes(settings.dtype)
    cap = int(row_bytes * 1.25)
    engine = engine_kwargs(settings, None)
    engine["hidden_states_config"] = {"layers": layers, "max_bytes_per_request": cap}
    engine["max_model_len"] = prompt_len + 16
    spec = workload_spec(
        settings,
        path,
        sizes,
        prompts=1,
        prompt_len=prompt_len,
        max_tokens=1,
        rounds=settings.rounds,
        variants={"states": {"prompt": True, "output": False}, "plain": None},
        engine=engine,
    )
    spec["mode"] = "mp"
    result = run_workload(sys.executable, spec)
    out = result["timings"]
    step_tokens = result["engine"]["config"]["max_num_batched_tokens"]
    step_bytes = min(step_tokens, prompt_len) * (row_bytes // prompt_len)
    bound = cap + step_bytes
    rounds = []
    for r, (with_states, plain) in enumerate(
        zip(out["states"], out["plain"], strict=True)
    ):
        growth = with_states["peak_rss_engine_core"] - plain["peak_rss_engine_core"]
        frontend = with_states["peak_rss_frontend"] - plain["peak_rss_frontend"]
        assert with_states["state_bytes"] == row_bytes, (with_states, row_bytes)
        rounds.append(
            {
                "round": r,
                "states": with_states,
                "plain": plain,
                "row_bytes": row_bytes,
                "cap_bytes": cap,
                "step_bytes": step_bytes,
                "engine_core_growth_bytes": growth,
                "frontend_growth_bytes": frontend,
                "ratio": growth / bound,
            }
        )
    summary = summarize(
        [r["ratio"] for r in rounds],
        f"engine-core peak RSS growth with states of a {prompt_len}-token prompt "
        f"(all {len(layers)} layers) / (max_bytes_per_request (1.25x its rows) "
        "+ one step's rows)",
        False,
        1.0,
    )
    result = engine_result(
        "memory",
        "peak resident memory of the engine core under one long prompt-states "
        "request against the same request without states (multiprocess engine, "
        "alternating); the growth must stay under the per-request byte cap "
        "plus the rows of one scheduler step in flight",
        settings,
        rounds,
        summary,
        memory={"with states": out["states"], "without states": out["plain"]},
        prompts=1,
        prompt_len=prompt_len,
        max_tokens=1,
        row_bytes=row_bytes,
        cap_bytes=cap,
        step_bytes=step_bytes,
    )
    return [result]
