"""Hidden states under async scheduling, vLLM's default on GPU: the scheduler
plans step N+1 before step N's tokens are known, optimistically past drafts
that may be rejected. Model Runner V2 on CPU with async scheduling turned back
on after the platform's config pass, with and without ngram speculation (both
accepted and rejected drafts), every row against HF."""

from __future__ import annotations

import pytest
import torch

from vllm_hs.hf_reference import assert_states_close, hf_greedy, hf_hidden_states
from vllm_hs.models.tiny import build_tiny_model, seeded_prompt
from vllm_hs_testing.engines import (
    MODES,
    NGRAM,
    PREEMPTING,
    async_scheduling_on_cpu,
    engine,
    engine_metric,
)
from vllm_hs_testing.hf_checks import Expect, run_cases
from vllm_hs_testing.requests import greedy, repeated_prompt, tokens_prompt

RESOLVED = [0, 2, 4, "final_norm"]


# The multiprocess engine core validates its config again when it starts, and
# vLLM refuses async scheduling with the CPU's ngram proposer there (only its
# GPU ngram proposer supports it): async with speculation runs in-process.
ENGINES = [("inproc", "ngram"), ("inproc", "none"), ("mp", "none")]
assert {mode for mode, _ in ENGINES} == set(MODES)


@pytest.fixture(scope="module", params=ENGINES, ids=lambda p: f"{p[0]}-{p[1]}")
def async_engine(request, llama_fp32):
    mode, spec = request.param
    extra = {"speculative_config": NGRAM} if spec == "ngram" else {}
    with (
        async_scheduling_on_cpu(),
        engine(
            llama_fp32,
            mode,
            dtype="float32",
            hidden_states_config={"layers": [0, 2, -1, "final_norm"]},
            enable_prefix_caching=True,
            **PREEMPTING,
            **extra,
        ) as llm,
    ):
        config = llm.llm_engine.vllm_config
        assert config.scheduler_config.async_scheduling
        assert config.use_v2_model_runner
        yield llm, f"{mode} async {spec}", spec


def test_rows_equal_hf(async_engine, llama_fp32):
    """Mixed batches (all rows, output only, windows, the last row, a layer
    subset, no states) of repetitive prompts: with ngram, drafts are accepted
    (several rows a step) and rejected (rows dropped, the next step scheduled
    past them); under preemption too (8 x 100 tokens in a 640-token cache)."""
    llm, what, spec = async_engine
    draft_metric = "vllm:spec_decode_num_draft_tokens"
    accepted_metric = "vllm:spec_decode_num_accepted_tokens"
    if spec == "ngram":
        drafts_before = engine_metric(llm, draft_metric)
        accepted_before = engine_metric(llm, accepted_metric)
    preemptions_before = engine_metric(llm, "vllm:num_preemptions")
    windows = [[20, 30], [45, 70]]
    cases = []
    for i in range(8):
        prompt = repeated_prompt(500 + i, 60, 5 + i % 3)
        hs, expect = {
            0: ({}, Expect(RESOLVED)),
            1: ({"prompt": False}, Expect(RESOLVED, prompt=False)),
            2: (None, None),
            3: ({"positions": windows}, Expect(RESOLVED, positions=windows)),
            4: ({"positions": "last"}, Expect(RESOLVED, positions="last")),
            5: ({"layers": ["final_norm", 0]}, Expect(["final_norm", 0])),
            6: ({}, Expect(RESOLVED)),
            7: ({"prompt": False}, Expect(RESOLVED, prompt=False)),
        }[i]
        cases.append((prompt, greedy(40, hidden_states=hs), expect))
    outputs = run_cases(llm, cases, llama_fp32, torch.float32, f"[{what}]")
    for i, (out, (prompt, sp, _)) in enumerate(zip(outputs, cases, strict=True)):
        assert out.outputs[0].finish_reason == "length", (what, i)
        assert list(out.outputs[0].token_ids) == hf_greedy(
            llama_fp32, prompt, sp.max_tokens
        ), f"[{what}] request {i}: tokens differ from HF greedy"
    assert engine_metric(llm, "vllm:num_preemptions") > preemptions_before
    if spec == "ngram":
        drafts = engine_metric(llm, draft_metric) - drafts_before
        accepted = engine_metric(llm, accepted_metric) - accepted_before
        assert 0 < accepted < drafts, (accepted, drafts)


def test_weight_reload_and_cache_reset_serve_only_new_rows(async_engine, llama_fp32):
    """An RL loop: prompt rows published to the AuxOutput store under the old
    weights, new weights of the same shapes loaded in place, the prefix cache
    reset. The same prompt then gives rows of the new weights only: computed
    (the reset emptied the cache), then from a prefix-cache hit served by the
    store's new generation. Last in this module: it loads the old weights back."""
    llm, what, _ = async_engine
    other = str(build_tiny_model("llama", "float32", seed=7))
    prompt = seeded_prompt(900, 80)  # two full 32-token blocks publish
    layers = [0, 2, 4, "final_norm"]

    def prompt_rows(model_dir: str, label: str, cached: bool) -> None:
        [out] = llm.generate(
            [tokens_prompt(prompt)], greedy(2, hidden_states={}), use_tqdm=False
        )
        assert (out.num_cached_tokens > 0) == cached, (what, label)
        expected = hf_hidden_states(model_dir, prompt, layers)
        assert_states_close(
            out.prompt_hidden_states,
            expected,
            dtype=torch.float32,
            what=f"[{what}] {label}",
        )

    assert llm.reset_prefix_cache()
    prompt_rows(llama_fp32, "old weights", cached=False)
    prompt_rows(llama_fp32, "old weights, hit", cached=True)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": other})
        assert llm.reset_prefix_cache()
        prompt_rows(other, "new weights", cached=False)
        prompt_rows(other, "new weights, hit", cached=True)
    finally:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": llama_fp32})
        assert llm.reset_prefix_cache()
