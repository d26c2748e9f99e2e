"""Shared-system-prompt workload with prompt hidden states: prefix-cache hits
served from the AuxOutput store (`hidden_states_config.store_bytes`, 1 GiB:
rows of the engine's layers keyed by KV block hash) against recomputing every
prompt (`store_bytes=0`: prompt-state requests never use prefix-cache hits).

Each variant runs in its own process (one engine each), alternately, `--rounds`
times. A process first sends one request (its rows fill the store), then
`--batches` timed batches of `--prompts` requests: the same system prompt of
`--system-len` tokens plus a fresh user part of `--user-len` tokens each,
prefill only (max_tokens=1), prompt states of all four of the engine's layers
(the store keeps only rows of requests asking for every layer; a hit whose
rows it does not all hold is recomputed).

    python -m benchmarks.prefix_store [--model large] [--rounds 3]

Writes benchmarks/results/v<vllm version>/prefix_store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import machine_facts, now, summarize, write_script_result
from benchmarks.suites import MODELS, run_workload


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_hs.models.tiny import build_tiny_model

    sizes = MODELS[spec["model"]]
    path = str(build_tiny_model("llama", "float32", **sizes))
    num_layers = sizes.get("num_hidden_layers", 4)
    layers = list(dict.fromkeys([1, num_layers // 2, num_layers - 1, num_layers]))
    llm = LLM(
        path,
        dtype=spec["dtype"],
        enforce_eager=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=spec["system_len"] + spec["user_len"] + 16,
        seed=0,
        hidden_states_config={
            "layers": layers,
            "store_bytes": spec["store_bytes"],
        },
    )
    vocab = sizes.get("vocab_size", 1024)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(8, vocab, (n,), generator=gen).tolist()

    system = tokens(spec["system_len"])
    params = SamplingParams(max_tokens=1, hidden_states={})

    def batch(n: int) -> tuple[float, float]:
        prompts = [
            TokensPrompt(prompt_token_ids=system + tokens(spec["user_len"]))
            for _ in range(n)
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        for out, prompt in zip(outs, prompts, strict=True):
            assert out.prompt_hidden_states.shape[0] == len(prompt["prompt_token_ids"])
        return seconds, sum(o.num_cached_tokens for o in outs) / len(outs)

    batch(1)  # the system prompt's rows (and KV) are stored now
    timings = []
    for _ in range(spec["batches"]):
        seconds, cached = batch(spec["prompts"])
        timings.append({"seconds": seconds, "mean_cached_tokens": cached})
    return {"timings": timings, "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="large", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.worker:
        result = _worker(json.loads(args.worker))
        print("WORKLOAD_RESULT " + json.dumps(result), flush=True)
        return 0

    import vllm

    base = {
        "model": args.model,
        "dtype": args.dtype,
        "system_len": args.system_len,
        "user_len": args.user_len,
        "prompts": args.prompts,
        "batches": args.batches,
    }
    variants = {"recompute": 0, "store": 1 << 30}
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    rounds = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r}
        for name, capacity in variants.items():
            row[name] = run_workload(
                sys.executable,
                {**base, "store_bytes": capacity},
                module="benchmarks.prefix_store",
                flags=("--worker",),
            )
        times = {
            name: min(t["seconds"] for t in row[name]["timings"]) for name in variants
        }
        row["ratio"] = times["recompute"] / times["store"]
        rounds.append(row)
        cached = row["store"]["timings"][0]["mean_cached_tokens"]
        print(
            f"round {r}: recompute {times['recompute']:.2f} s, store "
            f"{times['store']:.2f} s, speed-up {row['ratio']:.2f}x, "
            f"mean cached tokens with the store {cached:.0f}",
            flush=True,
        )
    result = {
        "suite": "prefix_store",
        "description": __doc__.split("\n\n")[0],
        "settings": {
            **base,
            "prompt_len": args.system_len + args.user_len,
            "max_tokens": 1,
            "rounds": args.rounds,
            "vllm": vllm.__version__,
        },
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "machine": machine_facts(),
        "rounds": rounds,
        "summary": asdict(
            summarize(
                [r["ratio"] for r in rounds],
                "batch time recomputing prompts / with hits served from the store",
                True,
                1.0,
            )
        ),
        "started": now(),
        "seconds": time.perf_counter() - t0,
    }
    out = write_script_result(result, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
