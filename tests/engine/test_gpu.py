"""The channel on CUDA: MRV1 selected, async scheduling (non-blocking D2H copy
of the rows in `AsyncGPUModelRunnerOutput`) and CUDA graphs on, checked against
HF. Skipped without CUDA; run it on a GPU machine with the patched CUDA wheel
(`vllm-hs wheel --vllm vllm==0.32.0`)."""

from __future__ import annotations

import pytest
import torch
from harness import MODES, Expect, engine, greedy, run_cases, seeded_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_channel_on_cuda(mode, dtype, tmp_path_factory):
    from vllm_hs.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model("llama", dtype))
    layers = [0, 2, -1, "final_norm"]
    with engine(
        model_dir,
        mode,
        hidden_states_config={"layers": layers},
        max_num_batched_tokens=64,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=None,
    ) as llm:
        config = llm.llm_engine.vllm_config
        assert not config.use_v2_model_runner, "hidden states must select MRV1"
        assert config.scheduler_config.async_scheduling
        assert config.compilation_config.cudagraph_mode != 0
        resolved = [0, 2, 4, "final_norm"]
        cases = [
            (seeded_prompt(400, 150), greedy(12, hidden_states={}), Expect(resolved)),
            (seeded_prompt(401, 20), greedy(12), None),
            (
                seeded_prompt(402, 33),
                greedy(9, hidden_states={"layers": ["final_norm", 0], "prompt": False}),
                Expect(["final_norm", 0], prompt=False),
            ),
        ]
        # GPU kernels (TF32, fused ops) differ from HF on CPU more than fp32
        # CPU kernels do: compare with the bf16 tolerance.
        run_cases(llm, cases, model_dir, dtype, f"[cuda {mode}]", torch.bfloat16)
