"""Patch 0002: vLLM's own extract_hidden_states path runs on CPU (our benchmark
baseline): right rows in its files, and finished requests are released.

Native convention: `eagle_aux_hidden_state_layer_ids` k is the residual stream
entering decoder layer k, the same as our layer id k (HF `hidden_states[k]`).
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from vllm_hs.hf_reference import assert_states_close, hf_hidden_states
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import engine
from vllm_hs_testing.requests import greedy, tokens_prompt

LAYERS = [1, 2, 3]


def test_native_extraction_on_cpu(llama_fp32: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "native"
    with engine(
        llama_fp32,
        "inproc",
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}
            },
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(out_dir)},
        },
    ) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        finished: dict[str, list[int]] = {}
        for batch in range(3):
            prompts = [seeded_prompt(100 * batch + i, 20 + 9 * i) for i in range(3)]
            outs = llm.generate([tokens_prompt(p) for p in prompts], greedy(1))
            # A finished request's file is written on a later engine step
            # (upstream behaviour); the next batch provides it.
            for out, prompt in zip(outs, prompts, strict=True):
                finished[out.kv_transfer_params["hidden_states_path"]] = prompt
        llm.generate([tokens_prompt(seeded_prompt(999, 5))], greedy(1))

        # Released: only the last (flush) request may still hold its blocks.
        # Before the fix every finished request stayed, never done sending.
        assert len(scheduler.requests) <= 1, sorted(scheduler.requests)

    assert len(finished) == 9
    for path, prompt in finished.items():
        tensors = load_file(path)
        assert tensors["token_ids"].tolist() == prompt
        expected = hf_hidden_states(llama_fp32, prompt, LAYERS, dtype="float32")
        assert_states_close(
            tensors["hidden_states"],
            expected,
            dtype="float32",
            what=f"native file {Path(path).name}",
            layers=LAYERS,
        )
