"""Prefill-only extraction to disk: the vllm-hs channel against vLLM's own
extract_hidden_states connector, separate engine processes run alternately,
under three CPU thread placements (native, native_omp_all, native_default)."""

from __future__ import annotations

import statistics
import sys
import tempfile
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


def _prefill_spec(
    settings: EngineSettings, path: str, sizes: dict[str, int], **kw: Any
) -> dict[str, Any]:
    return workload_spec(
        settings,
        path,
        sizes,
        max_tokens=1,
        write_dir=tempfile.mkdtemp(prefix="vllm-hs-bench-"),
        **kw,
    )


# How the CPU engines' OpenMP threads are placed (vLLM's CPU backend binds its
# worker's threads to cores; ignored on GPUs). By default vLLM reserves one core
# for the frontend and scheduler, and ONE MORE when a KV connector is configured
# (vllm/utils/ompmultiprocessing.py: "for nixl_connector under p/d case"). When
# the cores it would bind number no more than the reservation, vLLM reserves
# NONE: on 2 cores the native engine (which needs a KV connector) computes on 2
# OpenMP threads and the channel engine on 1; from 3 cores on, the native engine
# gets one thread fewer than the channel engine instead. Neither is a like for
# like comparison; VLLM_CPU_NUM_OF_RESERVED_CPU sets the same reservation for
# both.
NATIVE_BINDINGS: dict[str, tuple[dict[str, str], str]] = {
    "native": (
        {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        "same CPU threads on both sides: one core reserved for the frontend "
        "and scheduler, OpenMP on the others (vLLM's default for an engine "
        "without a KV connector)",
    ),
    "native_omp_all": (
        {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        "same CPU threads on both sides: OpenMP on every core, none reserved",
    ),
    "native_default": (
        {},
        "each engine with vLLM's default CPU binding, which differs: the native "
        "engine's KV connector asks for a second reserved core; with too few "
        "cores vLLM reserves none, so on 2 cores native computes on 2 OpenMP "
        "threads and the channel engine on 1 (shown for the record: not a like "
        "for like comparison)",
    ),
}


def _native(settings: EngineSettings, name: str) -> list[Result]:
    """Prefill-only extraction to disk (max_tokens=1, states of every prompt
    token in `hs_{i}.safetensors` with hidden_states [T, K, H] and token_ids),
    the vllm-hs channel against vLLM's own extract_hidden_states +
    ExampleHiddenStatesConnector (made to run on CPU by patch 0002), same
    model, layers, dtype and engine settings; separate engine processes run
    alternately; each process runs a full-size warm-up batch, then times
    3 batches (their median is the process's figure).

    What each side does per batch. Channel: one forward with the layers
    captured in the model runner, the rows sent to the frontend in the engine
    outputs, then the caller saves one file per request. Native: one forward
    (aux layers kept), the sampled token, then the extract_hidden_states
    'drafter' copies the rows into a KV-cache-like buffer (cache-only
    attention), the connector gathers each finished request's rows from it on
    a later engine step and a thread in the engine's worker saves the file;
    the caller waits for each file's lock. Neither side computes fewer layers
    or skips the LM head (both compute logits for each request's last position
    only). Rounds also compare the plain prefill of the two engines (the
    generate call alone; on the native engine it includes the copy into the
    buffer, which cannot be switched off).

    Patch 0002 makes the connector run on CPU; since series revision 2 it
    also reports a CPU copy as done (before, get_finished took the None it
    stores for "no CUDA event" as "not tracked": the engine kept every
    finished request's KV blocks and kept stepping while idle; results before
    2026-12-01 were measured with that defect). Each native process runs 3
    timed batches.
    """
    env, binding = NATIVE_BINDINGS[name]
    path, sizes = model_dir(settings)
    layers = four_layers(sizes)
    per_process = 3
    channel = _prefill_spec(
        settings,
        path,
        sizes,
        rounds=per_process,
        variants={"plain": None, "extract": {"prompt": True, "output": False}},
        engine=engine_kwargs(settings, layers),
        env=env,
    )
    native_spec = _prefill_spec(
        settings,
        path,
        sizes,
        rounds=per_process,
        variants={"extract": None},
        native=True,
        env=env,
    )
    native_spec["engine"] = {
        **engine_kwargs(settings, None),
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": layers}
            },
        },
        "kv_transfer_config": {
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": native_spec["write_dir"]
            },
        },
    }

    def median_of(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(t[key] for t in runs)

    def side(spec: dict[str, Any]) -> dict[str, Any]:
        out = run_workload(sys.executable, spec)
        record: dict[str, Any] = {"timings": out["timings"], "engine": out["engine"]}
        for variant, runs in out["timings"].items():
            record[f"{variant}_tokens_per_s"] = median_of(runs, "tokens_per_s")
            record[f"{variant}_generate_tokens_per_s"] = median_of(
                runs, "generate_tokens_per_s"
            )
        return record

    rounds = alternate(
        settings.rounds,
        lambda: side(native_spec),
        lambda: side(channel),
        lambda a, b: b["extract_tokens_per_s"] / a["extract_tokens_per_s"],
    )
    for r in rounds:
        a, b = r["A"], r["B"]
        # Plain prefill on the channel engine against the native engine's
        # generate call (its forward plus the in-engine copy of the rows).
        r["prefill_ratio"] = (
            b["plain_generate_tokens_per_s"] / a["extract_generate_tokens_per_s"]
        )
        r["channel_extract_over_plain"] = (
            b["extract_tokens_per_s"] / b["plain_generate_tokens_per_s"]
        )
        print(
            f"    prefill channel/native {r['prefill_ratio']:.3f}, channel "
            f"extract/plain {r['channel_extract_over_plain']:.3f}; OpenMP threads "
            f"native {_omp(a['engine'])} channel {_omp(b['engine'])}",
            flush=True,
        )
    summary = summarize(
        [r["ratio"] for r in rounds],
        "vllm-hs extraction to disk / vLLM native extract_hidden_states "
        f"(tokens/s; {'default' if not env else 'same'} CPU threads)",
        True,
        None if name == "native_default" else 1.0,
    )
    result = engine_result(
        name,
        (_native.__doc__ or "") + "\n\nCPU threads: " + binding,
        settings,
        rounds,
        summary,
        memory={
            "native": [t for r in rounds for t in r["A"]["timings"]["extract"]],
            "channel extract": [
                t for r in rounds for t in r["B"]["timings"]["extract"]
            ],
        },
        cpu_binding_env=env,
        max_tokens=1,
        batches_per_process=per_process,
        layers=layers,
    )
    return [result]


def _omp(engine: dict[str, Any]) -> str:
    """The worker's CPU list, e.g. '[0]', from a workload's engine facts."""
    for p in engine.get("processes", []):
        if p["name"].startswith("VLLM::Worker"):
            return str(p["cpus"])
    return "?"


def native(settings: EngineSettings) -> list[Result]:
    return _native(settings, "native")


def native_omp_all(settings: EngineSettings) -> list[Result]:
    return _native(settings, "native_omp_all")


def native_default(settings: EngineSettings) -> list[Result]:
    return _native(settings, "native_default")
