"""The worker's gather of a step's hidden-state rows, at an 8B model's shape:
vLLM's `HiddenStatesWorker.prepare` (the patched wheel installed here: one
tensor for the step, each layer's rows copied into it once) against the form
it replaced (`index_select` per layer, then `torch.stack`: every row copied
twice), on the same sources, in rounds whose order rotates. A prefill step of
`step_rows` prompt rows, every row and all `layers` layers wanted; on CUDA when
torch sees a GPU, else on CPU. Each round checks that both give the same rows.

    python -m benchmarks run gather [--step-rows 8192] [--hidden-size 4096]

Writes benchmarks/results/v<vllm version>/gather.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, summarize
from benchmarks.rounds import run_rounds


@dataclass
class GatherSettings:
    step_rows: int = option(8192, "prompt rows gathered in the step")
    hidden_size: int = option(4096, "hidden size (an 8B model's)")
    layers: int = option(4, "layers per payload")
    dtype: str = option("bfloat16", "engine dtype (default: each suite's own)")
    rounds: int = option(5, "")


def _stacked(sources: list[Any], index: Any) -> Any:
    import torch

    return torch.stack([s.index_select(0, index) for s in sources], dim=1)


def measure(args: GatherSettings) -> list[Result]:
    import numpy as np
    import torch
    import vllm
    from vllm.config.hidden_states import FINAL_NORM, HiddenStatesConfig
    from vllm.distributed.aux_output_connector.hidden_states import (
        HiddenStatesModelCapture,
        HiddenStatesRequestSpec,
        HiddenStatesStepMetadata,
        HiddenStatesWorker,
    )
    from vllm.v1.hidden_states.params import HiddenStatesParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    num_aux = args.layers - 1
    # No store for prefix-cache hits: nothing is published.
    config = HiddenStatesConfig(layers=[*range(num_aux), FINAL_NORM], store_bytes=0)
    config.resolve(num_aux)
    worker = HiddenStatesWorker(
        config,
        16,  # KV block size (of the store's keys)
        HiddenStatesModelCapture(aux_layers=config.aux_layers),
        args.hidden_size,
        dtype,
    )
    # One request whose prompt chunk is the whole step (its prompt goes on).
    spec = HiddenStatesRequestSpec(HiddenStatesParams(), args.step_rows + 1)
    worker.begin_step(
        HiddenStatesStepMetadata(
            new_requests={"r": spec}, block_hashes={}, released=[], finished=()
        )
    )
    batch = SimpleNamespace(
        req_ids=["r"],
        query_start_loc_np=np.array([0, args.step_rows], dtype=np.int32),
        num_computed_tokens_np=np.array([0], dtype=np.int32),
    )
    # The model's outputs: a padded batch, as under CUDA graphs.
    padded = args.step_rows + 256
    sources = [
        torch.randn(padded, args.hidden_size, dtype=dtype, device=device)
        for _ in range(args.layers)
    ]
    hidden, aux = sources[-1], sources[:-1]
    index = torch.arange(args.step_rows, device=device)

    def timed(gather: Callable[[], Any]) -> Callable[[], dict[str, Any]]:
        def side() -> dict[str, Any]:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            rows = gather()
            if device == "cuda":
                torch.cuda.synchronize()
            return {"seconds": time.perf_counter() - start, "rows": rows}

        return side

    def prepared() -> Any:
        step = worker.prepare(batch, hidden, aux)
        assert step is not None and step.rows_device is not None
        return step.rows_device

    sides = {
        "stack": timed(lambda: _stacked(sources, index)),
        "prepare": timed(prepared),
    }
    rounds = []
    # Round 0 warms up; the order of the sides rotates round by round.
    for i, got in enumerate(run_rounds(args.rounds + 1, sides)):
        stack, prepare = got["stack"], got["prepare"]
        if not torch.equal(stack.pop("rows"), prepare.pop("rows")):
            raise AssertionError("prepare's rows differ from the stacked rows")
        if not i:
            continue
        rounds.append(
            {
                "round": i,
                "stack_s": stack["seconds"],
                "prepare_s": prepare["seconds"],
                "ratio": prepare["seconds"] / stack["seconds"],
            }
        )
        print(
            f"  round {i}: prepare {prepare['seconds'] * 1e3:.1f} ms, "
            f"index_select + stack {stack['seconds'] * 1e3:.1f} ms",
            flush=True,
        )
    worker.close()
    step_bytes = args.step_rows * args.layers * args.hidden_size * dtype.itemsize
    return [
        Result(
            suite="gather",
            description=(__doc__ or "").split("\n\n")[0],
            settings={
                "model": f"{args.hidden_size}-wide rows (torch only)",
                "step_rows": args.step_rows,
                "hidden_size": args.hidden_size,
                "layers": args.layers,
                "dtype": args.dtype,
                "device": device,
                "vllm": vllm.__version__,
            },
            rounds=rounds,
            summary=summarize(
                [r["ratio"] for r in rounds],
                "time of the worker's gather per step: vLLM's prepare / "
                "index_select + stack",
                higher_is_better=False,
                aim=None,
            ),
            extra={
                "bytes_copied_per_step": {
                    "prepare": step_bytes,
                    "index_select + stack": 2 * step_bytes,
                }
            },
        )
    ]
