"""Model Runner V1 with the patched wheel: plain generation as upstream, and a
clear refusal of hidden states, which are an AuxOutput kind and need Model
Runner V2 (as every AuxOutput kind does upstream). Runs in both sessions (the
V1 session runs only these, `mrv1`); the refusal forces V1 itself."""

from __future__ import annotations

import pytest

from vllm_hs.hf_reference import hf_greedy
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import engine
from vllm_hs_testing.requests import greedy, tokens_prompt

pytestmark = pytest.mark.mrv1


def test_plain_generation_matches_hf(llama_fp32):
    """The session's runner (V1 in the V1 session) serves requests unchanged."""
    prompts = [seeded_prompt(900 + i, 12 + 9 * i) for i in range(3)]
    with engine(llama_fp32, "inproc", dtype="float32", enforce_eager=True) as llm:
        outputs = llm.generate(
            [tokens_prompt(p) for p in prompts], greedy(8), use_tqdm=False
        )
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_hidden_states is None
        assert list(out.outputs[0].token_ids) == hf_greedy(llama_fp32, prompt, 8)


def test_hidden_states_need_model_runner_v2(llama_fp32, monkeypatch):
    import vllm.envs
    from vllm import LLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm.envs.disable_envs_cache()
    try:
        with pytest.raises(ValueError, match="requires Model Runner V2"):
            LLM(
                llama_fp32,
                dtype="float32",
                enforce_eager=True,
                hidden_states_config={"layers": [0, "final_norm"]},
            )
    finally:
        vllm.envs.disable_envs_cache()
