"""Extraction throughput of `vllm-hs extract` against plain prefill on the same
engine, and against HF transformers on the same data and machine.

    python -m benchmarks run extraction [--model tiny|large] [--rounds 6]

Sides, on the conversations shipped with vllm-hs rendered by the model's chat
template (prompt tokens only; every token is computed: the engine runs without
prefix caching, since prompt-state requests never read it):

- extract: `vllm_hs.extract.job.extract` into a fresh directory: engine, states
  transport, validation and the safetensors/Arrow writes (tokens/s of its loop);
- states: `LLM.generate` asking for prompt states (max_tokens=1), nothing written;
- plain: `LLM.generate` with max_tokens=1 and no states (the baseline).

The three alternate in rotating order for --rounds rounds on one engine (vLLM's
default multiprocess mode); ratios extract/plain and states/plain are reported as
median [min, max]. Then HF transformers (eager attention, same dtype, same
layers, `output_hidden_states=True` plus a hook for the pre-norm last layer)
runs the same token ids at batch 1 and batched with right padding; the result
compares its tokens/s with extract's. Every side of every round records the
peak resident memory of the frontend (this process), the engine core and its
worker separately (benchmarks.peak_rss.PeakRss). Writes
benchmarks/results/<vllm release>/extraction[-large].json.
"""

from __future__ import annotations

import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peak_rss import PeakRss
from benchmarks.protocol import option
from benchmarks.result import Result, memory_summary, spread, summarize
from benchmarks.rounds import run_rounds
from benchmarks.suites.engine import (
    MODELS,
    cpu_engine_kwargs,
    require_seeded,
    seeded_model,
)

AIM = 0.97


def _hf_side(
    model_dir: str,
    prompts: list[list[int]],
    layers: list[Any],
    dtype: str,
    batch_size: int,
    pad_id: int,
) -> dict[str, float]:
    """Tokens/s of HF transformers computing the same [T, K, H] states."""
    import torch

    from vllm_hs.hf_reference import load_hf_model

    model = load_hf_model(model_dir, dtype)
    num_layers = model.config.num_hidden_layers
    captured: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(
        lambda _m, args: captured.append(args[0])
    )
    tokens = sum(len(p) for p in prompts)
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                batch = prompts[start : start + batch_size]
                width = max(len(p) for p in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for row, prompt in enumerate(batch):
                    ids[row, : len(prompt)] = torch.tensor(prompt)
                    mask[row, : len(prompt)] = 1
                captured.clear()
                out = model(
                    input_ids=ids,
                    attention_mask=mask,
                    output_hidden_states=True,
                    use_cache=False,
                )
                hidden = out.hidden_states
                for row, prompt in enumerate(batch):
                    columns = [
                        captured[0][row] if k == num_layers else hidden[k][row]
                        for k in layers
                    ]
                    states = torch.stack(columns, dim=1)[: len(prompt)].contiguous()
                    assert states.shape[0] == len(prompt)
    finally:
        handle.remove()
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


@dataclass
class ExtractionSettings:
    model: str = option("tiny", "")
    rounds: int = option(6, "")
    conversations: int = option(
        300, "how many shipped conversations (extraction: all 300; storage: 100)"
    )
    repeat: int = option(
        2,
        "pass the conversations this many times per side (longer, steadier "
        "measurements)",
    )
    dtype: str = option("float32", "")
    hf_batch: int = option(8, "HF transformers' batch size besides batch 1")
    hf_conversations: int = option(
        100, "HF runs on the first N prompts only (a rate; HF at batch 1 is slow)"
    )
    hf_rounds: int = option(2, "HF runs per batch size")
    eager: bool = option(True, "", flag="--compile")
    workdir: str | None = option(None, "where extraction writes (default: a temp dir)")

    def __post_init__(self) -> None:
        require_seeded(self.model)


def measure(args: ExtractionSettings) -> list[Result]:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_hs.extract.inputs import (
        load_conversations,
        plan_samples,
        shipped_conversations_path,
    )
    from vllm_hs.extract.job import extract
    from vllm_hs.extract.settings import ExtractSettings
    from vllm_hs.layer_ids import default_layers

    sizes = MODELS[args.model]
    model_dir = seeded_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations, sha = load_conversations(shipped_conversations_path())
    conversations = conversations[: args.conversations] * args.repeat
    samples, skipped = plan_samples(conversations, tokenizer, max_length=1023)
    assert not skipped, skipped
    prompts = [list(s.input_ids) for s in samples]
    tokens = sum(len(p) for p in prompts)
    num_layers = sizes.get("num_hidden_layers", 4)
    layers: list[Any] = default_layers(num_layers)
    settings = {
        "model": args.model,
        "model_sizes": sizes,
        "dtype": args.dtype,
        "layers": layers,
        "conversations": len(prompts),
        "repeat": args.repeat,
        "tokens_per_side": tokens,
        "mean_tokens": round(tokens / len(prompts), 1),
        "rounds": args.rounds,
        "engine_mode": "multiprocess (vLLM default)",
        "enforce_eager": args.eager,
        "enable_prefix_caching": False,
        "hf_batch": args.hf_batch,
        "hf_conversations": min(args.hf_conversations, len(prompts)),
        "torch_threads": torch.get_num_threads(),
        "hf_attention": "eager",
    }
    print(f"model {args.model}, {len(prompts)} conversations, {tokens} tokens/side")

    llm = LLM(
        model_dir,
        hidden_states_config={"layers": layers},
        dtype=args.dtype,
        enforce_eager=args.eager,
        enable_prefix_caching=False,
        seed=0,
        **cpu_engine_kwargs(),
    )
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-hs-bench-"))
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def plain() -> dict[str, float]:
        started = time.perf_counter()
        llm.generate(
            token_prompts,
            SamplingParams(max_tokens=1, detokenize=False),
            use_tqdm=False,
        )
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "tokens_per_s": tokens / seconds}

    def states() -> dict[str, float]:
        params = SamplingParams(
            max_tokens=1,
            detokenize=False,
            hidden_states={"prompt": True, "output": False},
        )
        started = time.perf_counter()
        outs = llm.generate(token_prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        rows = sum(o.prompt_hidden_states.shape[0] for o in outs)
        assert rows == tokens
        return {"seconds": seconds, "tokens_per_s": tokens / seconds}

    def extraction() -> dict[str, float]:
        out = workdir / "out"
        shutil.rmtree(out, ignore_errors=True)
        settings = ExtractSettings(out, layers, sha, progress=False)
        result = extract(llm, conversations, settings, tokenizer)
        assert result.written_tokens == tokens and not result.skipped
        shutil.rmtree(out)
        return {
            "seconds": result.seconds,
            "tokens_per_s": tokens / result.seconds,
            "bytes": result.bytes,
        }

    sides = {"extract": extraction, "states": states, "plain": plain}
    try:
        for side in sides.values():  # warm-up
            side()
        rounds = []
        timed = {name: _with_peak_rss(side) for name, side in sides.items()}
        for r, measured in enumerate(run_rounds(args.rounds, timed)):
            base = measured["plain"]["tokens_per_s"]
            record = {
                "round": r,
                "order": list(measured),
                **measured,
                "ratio": measured["extract"]["tokens_per_s"] / base,
                "states_ratio": measured["states"]["tokens_per_s"] / base,
            }
            rounds.append(record)
            print(
                f"  round {r}: extract {measured['extract']['tokens_per_s']:,.0f} "
                f"states {measured['states']['tokens_per_s']:,.0f} plain "
                f"{base:,.0f} tok/s; extract/plain {record['ratio']:.3f}",
                flush=True,
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
        gc.collect()
        shutil.rmtree(workdir, ignore_errors=True)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf_prompts = prompts[: args.hf_conversations]
    hf = {}
    for name, batch in (("hf_batch1", 1), (f"hf_batch{args.hf_batch}", args.hf_batch)):
        runs = [
            _hf_side(model_dir, hf_prompts, layers, args.dtype, batch, pad_id)
            for _ in range(args.hf_rounds)
        ]
        hf[name] = {
            "batch_size": batch,
            "runs": runs,
            "tokens_per_s": spread([x["tokens_per_s"] for x in runs]),
        }
        print(f"  {name}: {hf[name]['tokens_per_s']['median']:,.0f} tok/s")

    extract_tps = statistics.median(r["extract"]["tokens_per_s"] for r in rounds)
    ratios = [r["ratio"] for r in rounds]
    comparisons = {
        "extract_tokens_per_s": spread([r["extract"]["tokens_per_s"] for r in rounds]),
        "states_tokens_per_s": spread([r["states"]["tokens_per_s"] for r in rounds]),
        "plain_tokens_per_s": spread([r["plain"]["tokens_per_s"] for r in rounds]),
        "states_over_plain": spread([r["states_ratio"] for r in rounds]),
        **{
            f"extract_over_{name}": extract_tps / side["tokens_per_s"]["median"]
            for name, side in hf.items()
        },
        "hf": hf,
        "bytes_per_token": rounds[0]["extract"]["bytes"] / tokens,
    }
    memory = memory_summary({name: [r[name] for r in rounds] for name in sides})
    suite = "extraction" if args.model == "tiny" else f"extraction-{args.model}"
    summary = summarize(ratios, "extract tokens/s / plain prefill tokens/s", True, AIM)
    print(
        f"extract/plain {summary.median:.3f} [{summary.min:.3f}, {summary.max:.3f}] "
        f"(aim >= {AIM}); states/plain "
        f"{comparisons['states_over_plain']['median']:.3f}; extract/HF batch 1 "
        f"{comparisons['extract_over_hf_batch1']:.2f}x, extract/HF batch "
        f"{args.hf_batch} {comparisons[f'extract_over_hf_batch{args.hf_batch}']:.2f}x"
    )
    result = Result(
        suite=suite,
        description=(
            "vllm-hs extract (engine + transport + validation + writes) tokens/s "
            "over plain prefill (max_tokens=1, no states) on the same engine, "
            "alternating; also HF transformers on the same data"
        ),
        settings=settings,
        rounds=rounds,
        summary=summary,
        memory=memory,
        extra={"comparisons": comparisons},
    )
    return [result]


def _with_peak_rss(side: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`side`, its record with the peak resident memory of each process."""

    def measured() -> dict[str, Any]:
        with PeakRss() as rss:
            record = side()
        record.update(rss.fields())
        return record

    return measured
