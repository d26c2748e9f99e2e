"""Preemption, bf16 Qwen3, and aborts: each on its own engine, both modes."""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_hs.testing.harness import (
    MODES,
    Expect,
    check_output,
    engine,
    engine_metric,
    greedy,
    run_cases,
    seeded_prompt,
)


@pytest.mark.mrv1
@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_recompute(mode, llama_fp32):
    """A KV cache of 320 tokens for 6 requests of 80: requests are preempted
    and recomputed; no row may be duplicated or missing (all rows, output
    only, position windows and the last rows)."""
    layers = [1, 3, "final_norm"]
    with engine(
        llama_fp32,
        mode,
        dtype="float32",
        hidden_states_config={"layers": layers},
        max_model_len=256,
        block_size=32,
        kv_cache_memory_bytes=320 * 2048,  # 2 KiB of KV per token in this model
        max_num_batched_tokens=64,
        max_num_seqs=6,
        disable_log_stats=False,
        enforce_eager=True,
    ) as llm:
        cases = []
        windows = [[30, 45], [60, 70]]  # across the prompt's end (40)
        for i in range(6):
            if i % 3 == 2:
                hs, expect = {"prompt": False}, Expect(layers, prompt=False)
            elif i == 1:
                hs, expect = {"positions": windows}, Expect(layers, positions=windows)
            elif i == 4:
                hs, expect = {"positions": "last"}, Expect(layers, positions="last")
            else:
                hs, expect = {}, Expect(layers)
            cases.append(
                (seeded_prompt(100 + i, 40), greedy(40, hidden_states=hs), expect)
            )
        outputs = run_cases(llm, cases, llama_fp32, torch.float32, f"[{mode}] req")
        preemptions = engine_metric(llm, "vllm:num_preemptions")
        assert preemptions > 0, "the test did not force a preemption"
        assert all(len(out.outputs[0].token_ids) == 40 for out in outputs)


@pytest.mark.parametrize("mode", MODES)
def test_qwen3_bf16(mode, qwen3_bf16):
    """Second architecture, bf16 weights: states keep the model's dtype."""
    layers = [1, -1, "final_norm"]
    with engine(
        qwen3_bf16,
        mode,
        hidden_states_config={"layers": layers},
        max_num_batched_tokens=32,
        enforce_eager=(mode == "inproc"),
    ) as llm:
        cases = [
            (
                seeded_prompt(200, 45),
                greedy(8, hidden_states={}),
                Expect([1, 4, "final_norm"]),
            ),
            (
                seeded_prompt(201, 12),
                greedy(6, hidden_states={"layers": ["final_norm", 1], "prompt": False}),
                Expect(["final_norm", 1], prompt=False),
            ),
            (seeded_prompt(202, 9), greedy(5), None),
        ]
        outputs = run_cases(llm, cases, qwen3_bf16, torch.bfloat16, f"[{mode}] req")
        assert outputs[0].prompt_hidden_states.dtype == torch.bfloat16
        assert outputs[1].outputs[0].hidden_states.dtype == torch.bfloat16


PARALLEL_LAYERS = [0, 2, 3, "final_norm"]


@pytest.mark.mrv1
@pytest.mark.parametrize("parallel", ["tp2", "pp2"])
def test_parallel_workers(parallel, llama_fp32, monkeypatch):
    """Two CPU workers (multiprocess). Tensor parallel: only the output rank
    captures, rows equal HF on both runners. Pipeline parallel (layers 0-1 on
    the first stage, 2-3 and the final norm on the second): Model Runner V2
    relays the first stage's ids to the last, where rows are captured; Model
    Runner V1 cannot, and refuses the engine."""
    from vllm_hs.testing import expected_model_runner

    # Two workers on this one-NUMA-node machine: one core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    size = {"tensor_parallel_size": 2} if parallel == "tp2" else {}
    if parallel == "pp2":
        size = {"pipeline_parallel_size": 2}
        if expected_model_runner() == "v1":
            with pytest.raises(Exception, match="pipeline parallelism needs Model"):
                with engine(
                    llama_fp32,
                    "mp",
                    dtype="float32",
                    hidden_states_config={"layers": PARALLEL_LAYERS},
                    **size,
                ):
                    pass
            return
    with engine(
        llama_fp32,
        "mp",
        dtype="float32",
        hidden_states_config={"layers": PARALLEL_LAYERS},
        max_num_batched_tokens=32,
        enforce_eager=True,
        **size,
    ) as llm:
        cases = [
            (
                seeded_prompt(300, 50),
                greedy(6, hidden_states={}),
                Expect(PARALLEL_LAYERS),
            ),
            (seeded_prompt(301, 9), greedy(4), None),
            (
                seeded_prompt(302, 20),
                greedy(5, hidden_states={"layers": [2, 0], "prompt": False}),
                Expect([2, 0], prompt=False),
            ),
        ]
        run_cases(llm, cases, llama_fp32, torch.float32, f"[{parallel}] req")


def _in_output_arena(llm, rows: torch.Tensor) -> bool:
    import numpy as np

    arena = llm.llm_engine.engine_core.output_arena
    base = np.frombuffer(arena._mmap, np.uint8).ctypes.data
    return base <= rows.untyped_storage().data_ptr() < base + len(arena._mmap)


def test_rows_through_shared_memory_held_reused_and_overflowed(llama_fp32):
    """Multiprocess engine, 4 MiB output arena, prompts of 1.2 MiB of rows in
    one step each. Worker to engine core: rows of 1 MiB or more go through the
    worker's shared-memory step buffers. Engine core to frontend: rows come as
    views of the output arena; while the caller holds them the arena fills and
    further rows take the socket; rows held are never overwritten; once
    dropped, their space serves new rows. Every row against HF, the held ones
    again after the next batches."""
    layers = [0, 1, 2, 3, 4, "final_norm"]  # 3 KiB of rows per token
    hs = {"output": False}
    with engine(
        llama_fp32,
        "mp",
        dtype="float32",
        hidden_states_config={"layers": layers, "output_arena_bytes": 4 << 20},
        max_num_batched_tokens=2048,
        max_num_seqs=8,
    ) as llm:
        assert llm.collective_rpc("hidden_states_row_pool") == ["SharedRowsPool"]
        expect = Expect(layers, output=False)

        def batch(first_seed: int, count: int) -> list:
            cases = [
                (
                    seeded_prompt(first_seed + i, 400),
                    greedy(2, hidden_states=hs),
                    expect,
                )
                for i in range(count)
            ]
            return run_cases(llm, cases, llama_fp32, torch.float32, f"{first_seed}+")

        def arena_rows(outputs: list) -> list[bool]:
            return [_in_output_arena(llm, out.prompt_hidden_states) for out in outputs]

        held = batch(300, 5)  # 6 MiB in one step: three fit
        assert sum(arena_rows(held)) == 3
        overflow = batch(310, 2)  # the arena is full of held rows
        assert arena_rows(overflow) == [False] * 2
        for i, out in enumerate(held):
            check_output(out, llama_fp32, expect, torch.float32, f"held {i}")
        del held, overflow, out
        gc.collect()
        reused = batch(320, 3)
        assert arena_rows(reused) == [True] * 3
