"""The benchmark suites: what each figure compares, and how.

- overhead: the patched engine (hidden_states_config set, no request asking)
  against the unpatched wheel of the same release, in separate processes run
  alternately: throughput and peak memory.
- capture: generation with states (4 layers, prompt and output) against
  without, on one patched engine, batches alternating.
- decode: the same with output states only, in a decode-heavy batch (64
  prompts of 16 tokens, 256 tokens each): the cost per request and step.
- transport, heavy_payload: prefill with every layer's states against the
  same batch without, on the default multiprocess engine: the wall time the
  states add per byte, as a share of this machine's memcpy bandwidth
  (transport), and the throughput ratio (heavy_payload).
- native, native_omp_all, native_default: prefill-only extraction to disk, the
  channel against vLLM's own extract_hidden_states connector; the CPU threads
  the same on both sides (one core reserved, or none), or each engine's default
  (which differ: see NATIVE_BINDINGS).
- memory: one long prompt-states request (all layers) against the same request
  without states: the engine core's peak memory growth against the per-request
  byte cap.
- runner: plain generation on Model Runner V2 without Triton (the series'
  torch kernels on CPU) against Model Runner V1, the same patched wheel, in
  separate processes run alternately (aim: V2 within 1.3x of V1).
Every workload records per-process peak memory (frontend, engine core, worker).
Extraction against plain prefill and HF transformers is `benchmarks/extraction.py`
(`python -m benchmarks.extraction`); the response encoding is
`benchmarks/response_encoding.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import SuiteResult, alternate, memory_summary, now, summarize

REPO_ROOT = Path(__file__).resolve().parents[1]

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "large": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
    },
}


@dataclass
class Settings:
    model: str = "large"
    mode: str = "mp"
    prompts: int = 32
    prompt_len: int = 256
    max_tokens: int = 32
    rounds: int = 4
    dtype: str = "bfloat16"
    eager: bool = True
    unpatched_python: str | None = None
    load_format: str = "auto"


def model_dir(settings: Settings) -> tuple[str, dict[str, int]]:
    """A built seeded model ("tiny", "large"), or any model directory (e.g. a
    real model's config with --load-format dummy, on a GPU)."""
    if settings.model not in MODELS:
        config = json.loads((Path(settings.model) / "config.json").read_text())
        config = config.get("text_config", config)
        sizes = {
            "num_hidden_layers": int(config["num_hidden_layers"]),
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": int(config["hidden_size"]),
        }
        return settings.model, sizes
    from vllm_hs.models.tiny import build_tiny_model

    sizes = MODELS[settings.model]
    path = build_tiny_model("llama", "float32", **sizes)
    return str(path), sizes


def engine_kwargs(settings: Settings, layers: list[Any] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": settings.dtype,
        "max_model_len": settings.prompt_len + settings.max_tokens + 16,
        "enforce_eager": settings.eager,
        "load_format": settings.load_format,
        # Rounds repeat the same prompts: with prefix caching, plain requests
        # would skip work that a prompt-state request does unless the
        # AuxOutput store holds the hit's rows (`store_bytes`).
        "enable_prefix_caching": False,
        "seed": 0,
    }
    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except ImportError:
        on_gpu = False
    if not on_gpu:
        kwargs["kv_cache_memory_bytes"] = 1 << 30
    if layers is not None:
        kwargs["hidden_states_config"] = {"layers": layers}
    return kwargs


def run_workload(
    python: str,
    spec: dict[str, Any],
    module: str = "benchmarks.workload",
    flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run `python -m module *flags '<spec json>'` and return the JSON it
    prints on its `WORKLOAD_RESULT ` line."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "HF_HUB_OFFLINE": "1",
        **spec.get("env", {}),
    }
    proc = subprocess.run(
        [python, "-m", module, *flags, json.dumps(spec)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("WORKLOAD_RESULT "):
            return json.loads(line.removeprefix("WORKLOAD_RESULT "))
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"workload failed (exit {proc.returncode}):\n{tail}")


def _spec(
    settings: Settings, path: str, vocab: int, **overrides: Any
) -> dict[str, Any]:
    spec = {
        "model": path,
        "vocab": vocab,
        "mode": settings.mode,
        "prompts": settings.prompts,
        "prompt_len": settings.prompt_len,
        "max_tokens": settings.max_tokens,
        "rounds": 1,
        "variants": {"plain": None},
        "engine": engine_kwargs(settings, None),
    }
    spec.update(overrides)
    return spec


def _result(
    name: str,
    description: str,
    settings: Settings,
    rounds,
    summary,
    t0,
    memory: dict[str, list[dict[str, Any]]] | None = None,
    **extra_settings: Any,
):
    from dataclasses import asdict

    return SuiteResult(
        suite=name,
        description=description,
        settings={**asdict(settings), **extra_settings},
        rounds=rounds,
        summary=summary,
        memory=memory_summary(memory) if memory else {},
        started=now(),
        seconds=time.perf_counter() - t0,
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
    settings: Settings,
    name: str,
    description: str,
    metric: str,
    aim: float,
    a: Side,
    b: Side,
    t0: float,
) -> SuiteResult:
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
    return _result(
        name,
        description,
        settings,
        rounds,
        summary,
        t0,
        memory={
            a[0]: [t for r in rounds for t in r["A"]["runs"]],
            b[0]: [t for r in rounds for t in r["B"]["runs"]],
        },
    )


def _overhead(settings: Settings, name: str, with_config: bool) -> SuiteResult | None:
    if not settings.unpatched_python:
        print(f"{name}: skipped (no --unpatched-python given)")
        return None
    t0 = time.perf_counter()
    path, sizes = model_dir(settings)
    vocab = sizes.get("vocab_size", 1024)
    layers = _four_layers(sizes) if with_config else None
    unpatched = _spec(settings, path, vocab, rounds=2)
    patched = _spec(
        settings, path, vocab, rounds=2, engine=engine_kwargs(settings, layers)
    )
    what = (
        f"hidden_states_config with {len(layers)} layers"
        if layers
        else "no hidden_states_config"
    )
    return _alternating_throughput(
        settings,
        name,
        f"patched engine ({what}), requests asking nothing, against the "
        "unpatched wheel of the same release (separate processes, alternating); "
        "rounds also record peak-memory ratios",
        f"throughput patched ({what}, no request asking) / unpatched",
        0.99,
        ("unpatched", settings.unpatched_python, unpatched),
        ("patched", sys.executable, patched),
        t0,
    )


def overhead(settings: Settings) -> SuiteResult | None:
    """The patched wheel as a drop-in: no hidden_states_config."""
    return _overhead(settings, "overhead", with_config=False)


def overhead_config(settings: Settings) -> SuiteResult | None:
    """An engine started with the channel, serving requests that ask nothing:
    the model emits aux hidden states every step (the compiled graph's outputs
    are fixed at start), so this is the channel's standing cost."""
    return _overhead(settings, "overhead_config", with_config=True)


def _four_layers(sizes: dict[str, int]) -> list[Any]:
    num_layers = sizes.get("num_hidden_layers", 4)
    return list(dict.fromkeys([1, num_layers // 2, num_layers - 1, num_layers]))


def capture(settings: Settings) -> SuiteResult:
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


def decode(settings: Settings) -> SuiteResult:
    """Generation with output states only, in a decode-heavy batch
    (DECODE_SHAPE, whatever --prompts/--prompt-len/--max-tokens say): the
    channel's cost per request and decode step, which `capture`'s long
    prompts hide."""
    import dataclasses

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
    settings: Settings,
    name: str,
    states: dict[str, Any],
    kinds: str,
    description: str,
) -> SuiteResult:
    t0 = time.perf_counter()
    path, sizes = model_dir(settings)
    vocab = sizes.get("vocab_size", 1024)
    layers = _four_layers(sizes)
    spec = _spec(
        settings,
        path,
        vocab,
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
    return _result(
        name,
        description,
        settings,
        rounds,
        summary,
        t0,
        memory={"without states": out["plain"], "with states": out["states"]},
    )


NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def speculative(settings: Settings) -> SuiteResult:
    """Generation under ngram speculative decoding (Model Runner V2) with
    4-layer prompt and output states against without, batches alternating on
    one patched engine; prompts end with 128 tokens of the model's own greedy
    continuation, so that drafts are found and accepted where it repeats
    itself. Records each batch's draft and accepted tokens: the acceptance rate
    must not change with states on (greedy, the same tokens)."""
    path, sizes = model_dir(settings)
    return _speculation(
        "speculative",
        speculative.__doc__,
        settings,
        path,
        sizes,
        NGRAM,
        engine_kwargs(settings, _four_layers(sizes)),
        self_continue=128,
    )


def eagle3(settings: Settings) -> SuiteResult:
    """Generation under EAGLE-3 speculative decoding (Model Runner V2, tiny
    model in float32) with 4-layer prompt and output states against without,
    batches alternating on one patched engine. The draft reads the target's
    layers 1, 2, 3 and the channel 1, 2, 3, 4 (one capture serves both); it is
    the tiny draft trained on the target's continuations of the 32 prompts
    used here (`vllm_hs.models.eagle3_draft`), so drafts are accepted.
    Records each batch's draft and accepted tokens: the acceptance rate must
    not change with states on."""
    if settings.model != "tiny":
        raise ValueError(
            "the eagle3 suite runs on --model tiny: its draft is trained for "
            f"the tiny model, not {settings.model!r}"
        )
    from vllm_hs.models.eagle3_draft import build_eagle3_draft, training_prompts

    path, sizes = model_dir(settings)
    draft = build_eagle3_draft(path)
    prompts = training_prompts(settings.prompts)
    engine = engine_kwargs(settings, _four_layers(sizes))
    engine["dtype"] = "float32"
    engine["max_model_len"] = len(prompts[0]) + settings.max_tokens + 16
    config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    return _speculation(
        "eagle3",
        eagle3.__doc__,
        settings,
        path,
        sizes,
        config,
        engine,
        prompt_ids=prompts,
        prompt_len=len(prompts[0]),
    )


def _speculation(
    name: str,
    doc: str | None,
    settings: Settings,
    path: str,
    sizes: dict[str, int],
    speculative_config: dict[str, Any],
    engine: dict[str, Any],
    **spec_overrides: Any,
) -> SuiteResult:
    """Throughput with 4-layer states / without under `speculative_config`,
    and the acceptance rate of each side, per round."""
    t0 = time.perf_counter()
    engine["speculative_config"] = speculative_config
    engine["disable_log_stats"] = False
    spec = _spec(
        settings,
        path,
        sizes.get("vocab_size", 1024),
        rounds=settings.rounds,
        variants={"plain": None, "states": {"prompt": True, "output": True}},
        engine=engine,
        spec_metrics=True,
        env={"VLLM_USE_V2_MODEL_RUNNER": "1"},
        **spec_overrides,
    )
    out = run_workload(sys.executable, spec)["timings"]
    rounds = []
    for r, (a, b) in enumerate(zip(out["plain"], out["states"], strict=True)):
        acceptance = [
            side["accepted_tokens"] / side["draft_tokens"]
            if side["draft_tokens"]
            else 0.0
            for side in (a, b)
        ]
        rounds.append(
            {
                "round": r,
                "A": a,
                "B": b,
                "ratio": b["tokens_per_s"] / a["tokens_per_s"],
                "acceptance_without": acceptance[0],
                "acceptance_with": acceptance[1],
            }
        )
        print(
            f"  round {r}: ratio {rounds[-1]['ratio']:.4f}, acceptance "
            f"{acceptance[0]:.3f} without / {acceptance[1]:.3f} with states",
            flush=True,
        )
    method = speculative_config["method"]
    summary = summarize(
        [r["ratio"] for r in rounds],
        f"throughput with states ({len(_four_layers(sizes))} layers, prompt+output) "
        f"/ without, {method} speculation on (acceptance per side in rounds)",
        True,
        0.97,
    )
    return _result(
        name,
        (doc or "").split("\n\n")[0].replace("\n    ", " "),
        settings,
        rounds,
        summary,
        t0,
        memory={"without states": out["plain"], "with states": out["states"]},
        speculative_config=speculative_config,
    )


TRANSPORT_MIN_ROUNDS = 21
"""transport's figure is the difference of two noisy wall times: it takes at
least this many rounds (batches alternate within one engine: cheap), and runs
without the peak-memory sampler."""
TRANSPORT_CAP = 100.0
"""The transport figure of a round whose states side added no measurable wall
time (noise made it as fast as plain, or faster): 100x memcpy, a cap that keeps
the figure finite and ordered."""


def transport(settings: Settings) -> list[SuiteResult]:
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
    t0 = time.perf_counter()
    settings = dataclasses.replace(
        settings, rounds=max(settings.rounds, TRANSPORT_MIN_ROUNDS)
    )
    path, sizes = model_dir(settings)
    vocab = sizes.get("vocab_size", 1024)
    num_layers = sizes.get("num_hidden_layers", 4)
    layers = list(range(num_layers + 1))
    spec = _spec(
        settings,
        path,
        vocab,
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
        * _dtype_bytes(settings.dtype),
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
    transport_result = _result(
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
        t0,
        max_tokens=1,
        layers=layers,
        ipc_hop_s=hop_s,
        memcpy_bytes_per_s=bandwidth,
    )
    heavy = _result(
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
        t0,
        max_tokens=1,
        layers=layers,
    )
    return [transport_result, heavy]


def probe(settings: Settings) -> SuiteResult:
    """A last-token probe: prefill only, the states of each prompt's last
    position (`positions="last"`), against the same batch without states and
    with every prompt row (what a probe had to ask for before positions),
    batches alternating on one engine. Rounds record the bytes each side
    delivered and its wall time."""
    t0 = time.perf_counter()
    path, sizes = model_dir(settings)
    vocab = sizes.get("vocab_size", 1024)
    layers = _four_layers(sizes)
    spec = _spec(
        settings,
        path,
        vocab,
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
    return _result(
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
        t0,
        max_tokens=1,
        layers=layers,
    )


LONG_PROMPT = 8192  # tokens of the memory suite's request (at least)


def memory(settings: Settings) -> SuiteResult:
    """One long prompt-states request (all L+1 layers, prefill only) against the
    same request without states, alternating on one multiprocess engine whose
    per-request cap is 1.25x that request's rows: how much the engine core's
    peak resident memory grows, against its bound. The engine core holds a
    request's prompt rows once (at most the cap) plus the rows of the step in
    flight (at most max_num_batched_tokens rows, received from the worker
    before they are folded in): the bound is their sum."""
    t0 = time.perf_counter()
    prompt_len = max(settings.prompt_len, LONG_PROMPT)
    path, sizes = model_dir(settings)
    if settings.model in MODELS:
        # The seeded model with room for the long prompt (same weights).
        from vllm_hs.models.tiny import build_tiny_model

        path = str(
            build_tiny_model(
                "llama",
                "float32",
                **sizes,
                max_position_embeddings=prompt_len + 64,
            )
        )
    vocab = sizes.get("vocab_size", 1024)
    num_layers = sizes.get("num_hidden_layers", 4)
    layers = list(range(num_layers + 1))
    hidden = sizes.get("hidden_size", 128)  # 128: the tiny model's default
    row_bytes = prompt_len * len(layers) * hidden * _dtype_bytes(settings.dtype)
    cap = int(row_bytes * 1.25)
    engine = engine_kwargs(settings, None)
    engine["hidden_states_config"] = {"layers": layers, "max_bytes_per_request": cap}
    engine["max_model_len"] = prompt_len + 16
    spec = _spec(
        settings,
        path,
        vocab,
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
    return _result(
        "memory",
        "peak resident memory of the engine core under one long prompt-states "
        "request against the same request without states (multiprocess engine, "
        "alternating); the growth must stay under the per-request byte cap "
        "plus the rows of one scheduler step in flight",
        settings,
        rounds,
        summary,
        t0,
        memory={"with states": out["states"], "without states": out["plain"]},
        prompts=1,
        prompt_len=prompt_len,
        max_tokens=1,
        row_bytes=row_bytes,
        cap_bytes=cap,
        step_bytes=step_bytes,
    )


def _dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2)


def _prefill_spec(settings: Settings, path: str, vocab: int, **kw: Any) -> dict:
    import tempfile

    return _spec(
        settings,
        path,
        vocab,
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


def _native(settings: Settings, name: str) -> SuiteResult:
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
    t0 = time.perf_counter()
    env, binding = NATIVE_BINDINGS[name]
    path, sizes = model_dir(settings)
    vocab = sizes.get("vocab_size", 1024)
    layers = _four_layers(sizes)
    per_process = 3
    channel = _prefill_spec(
        settings,
        path,
        vocab,
        rounds=per_process,
        variants={"plain": None, "extract": {"prompt": True, "output": False}},
        engine=engine_kwargs(settings, layers),
        env=env,
    )
    native_spec = _prefill_spec(
        settings,
        path,
        vocab,
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
        import statistics

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
    return _result(
        name,
        (_native.__doc__ or "") + "\n\nCPU threads: " + binding,
        settings,
        rounds,
        summary,
        t0,
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


def _omp(engine: dict[str, Any]) -> str:
    """The worker's CPU list, e.g. '[0]', from a workload's engine facts."""
    for p in engine.get("processes", []):
        if p["name"].startswith("VLLM::Worker"):
            return str(p["cpus"])
    return "?"


def native(settings: Settings) -> SuiteResult:
    return _native(settings, "native")


def native_omp_all(settings: Settings) -> SuiteResult:
    return _native(settings, "native_omp_all")


def native_default(settings: Settings) -> SuiteResult:
    return _native(settings, "native_default")


def runner(settings: Settings) -> SuiteResult:
    """Plain generation (no hidden_states_config) on Model Runner V2 without
    Triton (the series' torch kernels on CPU) against Model Runner V1, the
    same patched wheel, separate processes run alternately."""
    t0 = time.perf_counter()
    path, sizes = model_dir(settings)
    vocab = sizes.get("vocab_size", 1024)

    def spec(flag: str) -> dict[str, Any]:
        return {
            **_spec(settings, path, vocab, rounds=2),
            "env": {"VLLM_USE_V2_MODEL_RUNNER": flag},
        }

    return _alternating_throughput(
        settings,
        "runner",
        "plain generation on Model Runner V2 without Triton (torch kernels) "
        "against Model Runner V1, same patched wheel, separate processes "
        "alternating",
        "throughput Model Runner V2 (no Triton) / Model Runner V1",
        1 / 1.3,
        ("v1", sys.executable, spec("0")),
        ("v2", sys.executable, spec("1")),
        t0,
    )


SUITES = {
    "memory": memory,
    "overhead": overhead,
    "overhead_config": overhead_config,
    "capture": capture,
    "decode": decode,
    "transport": transport,
    "probe": probe,
    "speculative": speculative,
    "eagle3": eagle3,
    "native": native,
    "native_omp_all": native_omp_all,
    "native_default": native_default,
    "runner": runner,
}
