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

    python -m benchmarks run prefix_store [--model large] [--rounds 3]

Each process is `python -m benchmarks.suites.prefix_store '<spec json>'`.

Writes benchmarks/results/v<vllm version>/prefix_store.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, summarize
from benchmarks.rounds import run_rounds
from benchmarks.suites.engine import MODELS, require_seeded, run_workload, seeded_model


@dataclass
class PrefixStoreSettings:
    model: str = option("large", "")
    dtype: str = option("bfloat16", "")
    system_len: int = option(512, "tokens of the shared system prompt")
    user_len: int = option(32, "tokens of each fresh user part")
    prompts: int = option(16, "")
    batches: int = option(2, "timed batches per process")
    rounds: int = option(3, "")

    def __post_init__(self) -> None:
        require_seeded(self.model)


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sizes = MODELS[spec["model"]]
    path = seeded_model(spec["model"])
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


def measure(args: PrefixStoreSettings) -> list[Result]:
    import vllm

    base = asdict(args)
    del base["rounds"]
    variants = {"recompute": 0, "store": 1 << 30}
    sides = {
        name: _process(sys.executable, {**base, "store_bytes": capacity})
        for name, capacity in variants.items()
    }
    rounds = []
    for r, measured in enumerate(run_rounds(args.rounds, sides, rotate=False)):
        row: dict[str, Any] = {"round": r, **measured}
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
    result = Result(
        suite="prefix_store",
        description=(__doc__ or "").split("\n\n")[0],
        settings={
            **base,
            "prompt_len": args.system_len + args.user_len,
            "max_tokens": 1,
            "rounds": args.rounds,
            "vllm": vllm.__version__,
        },
        rounds=rounds,
        summary=summarize(
            [r["ratio"] for r in rounds],
            "batch time recomputing prompts / with hits served from the store",
            True,
            1.0,
        ),
    )
    return [result]


def _process(python: str, spec: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """One side: a process of this module running `spec`."""
    return lambda: run_workload(python, spec, module="benchmarks.suites.prefix_store")


if __name__ == "__main__":
    result = _worker(json.loads(sys.argv[1]))
    print("WORKLOAD_RESULT " + json.dumps(result), flush=True)
