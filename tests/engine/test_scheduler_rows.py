"""Row accounting in vLLM's own Scheduler, fed model-runner outputs with rows
that a faulty worker could send (a missing tail, a gap, a duplicate).

The real engine never produces such outputs (that is the point of the design),
so these drive the real `Scheduler.update_from_output` step by step with
`ModelRunnerOutput`s built here, as vLLM's own scheduler tests do. Rows carry
their position in every element, so a shifted or duplicated row shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

LAYERS: list[int | str] = [0, "final_norm"]
HIDDEN = 128  # the tiny llama
PROMPT_LEN = 8


def _rows(start: int, end: int) -> torch.Tensor:
    """Rows [start, end): row p is filled with p (2 layers x hidden)."""
    positions = torch.arange(start, end, dtype=torch.float32)
    return positions[:, None, None].expand(-1, len(LAYERS), HIDDEN).contiguous()


@pytest.fixture
def scheduler(llama_fp32: str) -> Any:
    from vllm.config import (
        CacheConfig,
        HiddenStatesConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=llama_fp32, dtype="float32", max_model_len=256, skip_tokenizer_init=True
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=256,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=False),
        hidden_states_config=HiddenStatesConfig(layers=list(LAYERS)),
    )
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=1000,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = 1000
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=16,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def _add_request(scheduler: Any, max_tokens: int, **hidden_states: Any) -> str:
    from vllm import HiddenStatesParams, SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        hidden_states=HiddenStatesParams(layers=list(LAYERS), **hidden_states),
    )
    request = Request(
        request_id="r",
        prompt_token_ids=list(range(10, 10 + PROMPT_LEN)),
        sampling_params=params,
        pooling_params=None,
    )
    scheduler.add_request(request)
    return request.request_id


def _step(scheduler: Any, token: int, rows: dict[str, tuple[int, torch.Tensor]]):
    """Schedule one step, report `token` for every request and `rows`; return
    this step's EngineCoreOutput of request "r" (or None)."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler_output = scheduler.schedule()
    req_ids = list(scheduler_output.num_scheduled_tokens)
    model_output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        hidden_states=rows or None,
    )
    engine_outputs = scheduler.update_from_output(scheduler_output, model_output)
    for outputs in engine_outputs.values():
        for output in outputs.outputs:
            if output.request_id == "r":
                return output
    return None


def test_complete_rows_are_emitted_once_in_order(scheduler):
    """Control: with every row present the request finishes by length and the
    rows are the right positions; a recomputed (duplicate) chunk is dropped."""
    from vllm.v1.engine import FinishReason

    _add_request(scheduler, max_tokens=3)
    first = _step(scheduler, 100, {"r": (0, _rows(0, PROMPT_LEN))})
    assert torch.equal(first.prompt_hidden_states, _rows(0, PROMPT_LEN))
    second = _step(scheduler, 101, {"r": (PROMPT_LEN - 1, _rows(PROMPT_LEN - 1, 9))})
    assert torch.equal(second.hidden_states, _rows(8, 9))
    last = _step(scheduler, 102, {"r": (9, _rows(9, 10))})
    assert last.finish_reason == FinishReason.LENGTH
    assert torch.equal(last.hidden_states, _rows(9, 10))


@pytest.mark.parametrize("want", ["prompt and output", "output only"])
def test_rows_missing_at_the_final_step_fail_the_request(scheduler, want):
    """The last step's rows never arrive: the request must end with an error,
    not with finish_reason length and one row short."""
    from vllm.v1.engine import FinishReason

    kwargs = {} if want == "prompt and output" else {"prompt": False}
    _add_request(scheduler, max_tokens=2, **kwargs)
    # The prefill's rows: the prompt's, or none when only output rows are wanted.
    first = _step(
        scheduler, 100, {"r": (0, _rows(0, PROMPT_LEN))} if not kwargs else {}
    )
    assert first.finish_reason is None
    last = _step(scheduler, 101, {})  # position 8's row is missing
    assert last.finish_reason == FinishReason.ERROR
    assert last.hidden_states is None
    assert not scheduler.requests, "the failed request was not freed"


def test_prompt_rows_missing_at_the_first_token_fail_the_request(scheduler):
    """A prompt-only request whose last prompt row never arrived."""
    from vllm.v1.engine import FinishReason

    _add_request(scheduler, max_tokens=1, output=False)
    only = _step(scheduler, 100, {"r": (0, _rows(0, PROMPT_LEN - 1))})
    assert only.finish_reason == FinishReason.ERROR
    assert only.prompt_hidden_states is None


def test_a_gap_mid_generation_fails_the_request_in_that_step(scheduler):
    from vllm.v1.engine import FinishReason

    _add_request(scheduler, max_tokens=5)
    _step(scheduler, 100, {"r": (0, _rows(0, PROMPT_LEN))})
    failed = _step(scheduler, 101, {"r": (9, _rows(9, 10))})  # row 8 skipped
    assert failed.finish_reason == FinishReason.ERROR
    assert failed.hidden_states is None
    assert not scheduler.requests
