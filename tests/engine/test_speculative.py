"""Hidden states with speculative decoding on (ngram drafts, both model runners):
rows of accepted tokens only, position-aligned as without speculation, checked
against HF on the final sequence; greedy tokens equal HF's greedy tokens (the
tokens without speculation); mixed batches with and without states, windows,
the last row, stop tokens and max_tokens inside a step's accepted drafts, and
preemption under speculation. One engine per mode."""

from __future__ import annotations

import pytest
import torch

from vllm_hs.hf_reference import hf_greedy
from vllm_hs_testing.engines import (
    NGRAM,
    PREEMPTING,
    engine,
    engine_metric,
    speculation_modes,
)
from vllm_hs_testing.hf_checks import Expect, run_cases
from vllm_hs_testing.requests import greedy, repeated_prompt
from vllm_hs_testing.speculative import check_stop_inside_drafts, speculative_cases

LAYERS = [0, 2, -1, "final_norm"]
RESOLVED = [0, 2, 4, "final_norm"]
DTYPE = torch.float32


@pytest.fixture(scope="module", params=speculation_modes())
def spec_engine(request, llama_fp32):
    """ngram speculation (3 drafts), a KV cache of 640 tokens for up to 8
    requests (preemptions under load), chunked prefill of 64 tokens."""
    with engine(
        llama_fp32,
        request.param,
        dtype="float32",
        hidden_states_config={"layers": LAYERS},
        speculative_config=NGRAM,
        **PREEMPTING,
    ) as llm:
        yield llm, request.param


def test_rows_of_accepted_tokens_equal_hf(spec_engine, llama_fp32):
    llm, mode = spec_engine
    draft_metric = "vllm:spec_decode_num_draft_tokens"
    accepted_metric = "vllm:spec_decode_num_accepted_tokens"
    drafts_before = engine_metric(llm, draft_metric)
    accepted_before = engine_metric(llm, accepted_metric)
    prompts = [repeated_prompt(200 + i, 40 + 3 * i, 5 + i % 3) for i in range(8)]
    cases = speculative_cases(prompts, [[20, 30], [45, 70]])
    outputs = run_cases(llm, cases, llama_fp32, DTYPE, f"[{mode}] spec")
    for i, (out, (prompt, sp, _)) in enumerate(zip(outputs, cases, strict=True)):
        assert list(out.outputs[0].token_ids) == hf_greedy(
            llama_fp32, prompt, sp.max_tokens
        ), f"[{mode}] request {i}: tokens differ from HF greedy"
    drafts = engine_metric(llm, draft_metric) - drafts_before
    accepted = engine_metric(llm, accepted_metric) - accepted_before
    # Both paths ran: drafts accepted (several rows in a step) and rejected
    # (rows dropped).
    assert 0 < accepted < drafts, (accepted, drafts)


def test_stop_token_inside_accepted_drafts(spec_engine, llama_fp32):
    """A stop token among a step's accepted tokens: the tokens after it and
    their rows are dropped; the rows end at the stop token's input."""
    llm, mode = spec_engine
    prompts = [repeated_prompt(300 + i, 48, 4 + i) for i in range(4)]
    check_stop_inside_drafts(llm, llama_fp32, prompts, RESOLVED, f"[{mode}] spec stop")


def test_preemption_under_speculation(spec_engine, llama_fp32):
    """Eight requests of 100 tokens in a 640-token KV cache: requests are
    preempted and recomputed mid-speculation; no row duplicated or missing."""
    llm, mode = spec_engine
    before = engine_metric(llm, "vllm:num_preemptions")
    cases = [
        (
            repeated_prompt(400 + i, 60, 6),
            greedy(40, hidden_states={} if i % 2 == 0 else {"prompt": False}),
            Expect(RESOLVED) if i % 2 == 0 else Expect(RESOLVED, prompt=False),
        )
        for i in range(8)
    ]
    run_cases(llm, cases, llama_fp32, DTYPE, f"[{mode}] spec preempt")
    assert engine_metric(llm, "vllm:num_preemptions") > before, "no preemption forced"


def test_speculative_methods_the_channel_refuses(llama_fp32):
    """Draft models are refused with a clear error."""
    from vllm.engine.arg_utils import EngineArgs

    def config(spec: dict) -> None:
        EngineArgs(
            model=llama_fp32,
            dtype="float32",
            max_model_len=256,
            hidden_states_config={"layers": LAYERS},
            speculative_config=spec,
        ).create_engine_config()

    with pytest.raises(ValueError, match="not 'draft_model'"):
        config({"model": llama_fp32, "num_speculative_tokens": 2})
    config(NGRAM)
