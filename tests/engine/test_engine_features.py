"""Preemption, bf16 Qwen3, and aborts: each on its own engine, both modes."""

from __future__ import annotations

import pytest
import torch

from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import MODES, PREEMPTING, engine, engine_metric
from vllm_hs_testing.hf_checks import Expect, run_cases
from vllm_hs_testing.requests import greedy


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
        **{**PREEMPTING, "kv_cache_memory_bytes": 320 * 2048, "max_num_seqs": 6},
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
    """Second architecture, bf16 weights: states keep the model's dtype.
    Eager in both modes (compiling it took ~40 s of CI time): compiled engines
    are the shared multiprocess ones (tests/engine/conftest.py) and the
    compiled architectures of test_architectures."""
    layers = [1, -1, "final_norm"]
    with engine(
        qwen3_bf16,
        mode,
        hidden_states_config={"layers": layers},
        max_num_batched_tokens=32,
        enforce_eager=True,
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


@pytest.mark.parametrize("parallel", ["tp2", "pp2"])
def test_parallel_workers(parallel, llama_fp32, monkeypatch):
    """Two CPU workers (multiprocess). Tensor parallel: only the output rank
    captures, rows equal HF. Pipeline parallel (layers 0-1 on the first stage,
    2-3 and the final norm on the second): Model Runner V2 relays the first
    stage's ids to the last, where rows are captured."""
    # Two workers on this one-NUMA-node machine: one core each.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    size = {"tensor_parallel_size": 2} if parallel == "tp2" else {}
    if parallel == "pp2":
        size = {"pipeline_parallel_size": 2}
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
