"""Hidden states with EAGLE-3 speculative decoding (both model runners): the
drafter reads the target's aux layers 1, 2, 3 and the channel captures 0, 2,
4 and the final norm, so the model emits the union (layer 2 once). Rows are
checked against HF on the final sequence; greedy tokens equal HF's; and the
draft proposes and gets accepted exactly what it does on an engine without
the channel (same requests, same batch). The draft is a tiny one trained on
the target's continuations of `training_prompts()` (`vllm_hs.models.
eagle3_draft`), so drafts are both accepted and rejected there. The KV
cache is small enough that the mixed batch is preempted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_hs.hf_reference import hf_greedy
from vllm_hs.models.eagle3_draft import build_eagle3_draft, training_prompts
from vllm_hs_testing.engines import engine, engine_metric, speculation_modes
from vllm_hs_testing.hf_checks import Expect, run_cases
from vllm_hs_testing.requests import greedy, tokens_prompt
from vllm_hs_testing.speculative import check_stop_inside_drafts, speculative_cases

LAYERS = [0, 2, -1, "final_norm"]
RESOLVED = [0, 2, 4, "final_norm"]
DTYPE = torch.float32
SPEC_METRICS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    # 384 tokens of KV (2 KiB per token in the target, 512 B in the draft) in
    # blocks of 32: the mixed batch of `_cases()` needs 16 blocks, so requests
    # are preempted and recomputed mid-speculation.
    "block_size": 32,
    "kv_cache_memory_bytes": 384 * 2560,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "disable_log_stats": False,
    "enforce_eager": True,
}


@pytest.fixture(scope="module")
def eagle3_draft(llama_fp32) -> str:
    return str(build_eagle3_draft(llama_fp32))


def _spec(draft: str) -> dict:
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}


def _cases() -> list[tuple[list[int], object, Expect | None]]:
    """Eight requests on the draft's training prompts: states and none,
    output-only, windows, the last row, a layer subset; max_tokens ending
    inside a step."""
    return speculative_cases(training_prompts(8), [[10, 20], [30, 50]])


def _spec_counts(llm) -> list[float]:
    return [engine_metric(llm, name) for name in SPEC_METRICS]


def _one_at_a_time(llm, hidden_states: dict | None) -> tuple[list, list[float]]:
    """Tokens of `training_prompts(4)` sent one request at a time, and the
    draft counts they add: batches of one, whatever the engine mode (how
    requests reach the engine core decides how they are batched, and a batch
    of another shape may round a near-tie of the draft differently)."""
    before = _spec_counts(llm)
    tokens = []
    for prompt in training_prompts(4):
        (out,) = llm.generate(
            [tokens_prompt(prompt)],
            greedy(32, hidden_states=hidden_states),
            use_tqdm=False,
        )
        tokens.append(list(out.outputs[0].token_ids))
    counts = [a - b for a, b in zip(_spec_counts(llm), before, strict=True)]
    return tokens, counts


@pytest.fixture(scope="module")
def without_channel(llama_fp32, eagle3_draft):
    """`_one_at_a_time` on an engine without hidden_states_config."""
    with engine(
        llama_fp32, "inproc", speculative_config=_spec(eagle3_draft), **ENGINE_ARGS
    ) as llm:
        return _one_at_a_time(llm, None)


@pytest.fixture(scope="module", params=speculation_modes())
def eagle3_engine(request, llama_fp32, eagle3_draft, without_channel):
    """The engine with the channel; it starts once the in-process engine
    without it has closed (two in-process engines share the process's
    parallel groups)."""
    with engine(
        llama_fp32,
        request.param,
        hidden_states_config={"layers": LAYERS},
        speculative_config=_spec(eagle3_draft),
        **ENGINE_ARGS,
    ) as llm:
        yield llm, request.param


def test_rows_of_a_mixed_batch_equal_hf(eagle3_engine, llama_fp32):
    """Also under preemption: no row duplicated or missing."""
    llm, mode = eagle3_engine
    before = _spec_counts(llm)
    preemptions = engine_metric(llm, "vllm:num_preemptions")
    cases = _cases()
    outputs = run_cases(llm, cases, llama_fp32, DTYPE, f"[{mode}] eagle3")
    for i, (out, (prompt, sp, _)) in enumerate(zip(outputs, cases, strict=True)):
        assert list(out.outputs[0].token_ids) == hf_greedy(
            llama_fp32, prompt, sp.max_tokens
        ), f"[{mode}] request {i}: tokens differ from HF greedy"
    _, draft_tokens, accepted = (
        after - b for after, b in zip(_spec_counts(llm), before, strict=True)
    )
    # Drafts accepted (several rows in a step) and rejected (rows dropped).
    assert 0 < accepted < draft_tokens, (accepted, draft_tokens)
    assert engine_metric(llm, "vllm:num_preemptions") > preemptions


def test_the_channel_leaves_the_draft_unchanged(eagle3_engine, without_channel):
    """Every request asking for states (the drafter's layers 1 and 3 are
    emitted only for it; 2 is shared): the same tokens, drafts and accepted
    drafts as without the channel. A drafter given the channel's layers, or
    its own in another order, proposes other drafts."""
    llm, mode = eagle3_engine
    tokens, counts = _one_at_a_time(llm, {})
    tokens_without, counts_without = without_channel
    assert tokens == tokens_without
    assert counts == counts_without, (
        f"[{mode}] the channel changed speculation: drafts, draft tokens, "
        f"accepted {counts} vs {counts_without} without it"
    )
    assert counts[2] > 0


def test_stop_token_inside_accepted_drafts(eagle3_engine, llama_fp32):
    llm, mode = eagle3_engine
    prompts = training_prompts(12)[8:]
    check_stop_inside_drafts(
        llm, llama_fp32, prompts, RESOLVED, f"[{mode}] eagle3 stop"
    )


def test_eagle3_heads_without_aux_states_are_refused(
    llama_fp32, eagle3_draft, tmp_path: Path
):
    """An EAGLE-3 head that reads the target's last hidden state instead of
    aux states (``eagle_config.use_aux_hidden_state: false``) is refused at
    config time, on either model runner; speculation with pipeline parallelism
    too."""
    from vllm.engine.arg_utils import EngineArgs

    def config(draft: str, **kwargs) -> None:
        EngineArgs(
            model=llama_fp32,
            hidden_states_config={"layers": LAYERS},
            speculative_config=_spec(draft),
            **ENGINE_ARGS,
            **kwargs,
        ).create_engine_config()

    # The HF-format checkpoint such heads ship as (speculators' format has no
    # eagle_config): the draft's layer config under an EAGLE-3 architecture.
    # Engine config reads config.json only.
    head = tmp_path / "no-aux-head"
    head.mkdir()
    draft_config = json.loads((Path(eagle3_draft) / "config.json").read_text())
    hf_config = {
        **draft_config["transformer_layer_config"],
        "architectures": ["Eagle3LlamaForCausalLM"],
        "draft_vocab_size": draft_config["draft_vocab_size"],
        "eagle_config": {"use_aux_hidden_state": False},
    }
    (head / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="use_aux_hidden_state is false"):
        config(str(head))
    config(eagle3_draft)
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        config(eagle3_draft, pipeline_parallel_size=2)
