"""Model Runner V2 on CPU without Triton (the series' Not-for-upstream CPU
platform patch: torch implementations of its kernels) against Model Runner V1
on the same CPU.

Each case runs the same requests on an in-process V1 engine and an in-process
V2 engine (the runner forced with VLLM_USE_V2_MODEL_RUNNER, checked on every
worker): greedy tokens must be equal, and logprobs and prompt logprobs equal
within fp32 rounding (the two runners compute log-softmax with different
kernels). Seeded random sampling is not comparable across runners (V1 draws
from torch generators, V2 from Philox per request and position), so the
seeded case checks what V2 promises instead: the same seed gives the same
tokens whatever else is in the batch.

Runs in the v2 session only (it starts both runners itself). Two workers
(tensor and pipeline parallel) are checked on V2 alone, every row against HF
(test_engine_features' `test_parallel_workers`).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import vllm.envs

from vllm_hs.models.eagle3_draft import build_eagle3_draft, training_prompts
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import engine, engine_metric, expected_model_runner
from vllm_hs_testing.requests import greedy, repeated_prompt, tokens_prompt

LOGPROB_TOL = 1e-4  # fp32 log-softmax over a 1024-token vocabulary

BASE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "block_size": 32,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "disable_log_stats": False,
}


@pytest.fixture(autouse=True)
def _v2_session_only():
    if expected_model_runner() != "v2":
        pytest.skip("starts both runners itself: runs in the v2 session")


def _run_on(
    runner: str,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    engine_args: dict[str, Any],
    prompts: list[list[int]],
    params: Any,
    metrics: tuple[str, ...] = (),
    repeat: int = 1,
) -> tuple[list[Any], dict[str, float]]:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    vllm.envs.disable_envs_cache()  # an earlier in-process engine cached them
    try:
        # engine() checks every worker runs the runner the environment forces.
        with engine(model, "inproc", **{**BASE, **engine_args}) as llm:
            outputs = []
            for _ in range(repeat):
                outputs += llm.generate(
                    [tokens_prompt(p) for p in prompts], params, use_tqdm=False
                )
            values = {name: engine_metric(llm, name) for name in metrics}
    finally:
        vllm.envs.disable_envs_cache()
    return outputs, values


def _both(monkeypatch, model, engine_args, prompts, params, metrics=(), repeat=1):
    args = (model, engine_args, prompts, params, metrics, repeat)
    return _run_on("v1", monkeypatch, *args), _run_on("v2", monkeypatch, *args)


def _assert_logprobs_equal(a: Any, b: Any, what: str) -> None:
    """Two lists of per-position {token: Logprob} (or None) are the same: the
    same tokens with the same ranks, and values within LOGPROB_TOL."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side has no logprobs"
        return
    assert len(a) == len(b), f"{what}: {len(a)} positions against {len(b)}"
    for pos, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"{what}[{pos}]"
            continue
        assert x.keys() == y.keys(), f"{what}[{pos}]: tokens {x.keys()} {y.keys()}"
        for token in x:
            assert x[token].rank == y[token].rank, f"{what}[{pos}] rank of {token}"
            assert math.isclose(
                x[token].logprob, y[token].logprob, abs_tol=LOGPROB_TOL
            ), f"{what}[{pos}] {token}: {x[token].logprob} != {y[token].logprob}"


def _assert_same_outputs(v1: list[Any], v2: list[Any], case: str) -> None:
    assert len(v1) == len(v2)
    for i, (a, b) in enumerate(zip(v1, v2, strict=True)):
        what = f"{case} request {i}"
        _assert_logprobs_equal(a.prompt_logprobs, b.prompt_logprobs, what + " prompt")
        assert len(a.outputs) == len(b.outputs), what
        for j, (x, y) in enumerate(zip(a.outputs, b.outputs, strict=True)):
            assert list(x.token_ids) == list(y.token_ids), f"{what} output {j}"
            assert x.finish_reason == y.finish_reason, f"{what} output {j}"
            _assert_logprobs_equal(x.logprobs, y.logprobs, f"{what} output {j}")


def test_chunked_prefill_and_prefix_caching(monkeypatch, llama_fp32):
    """Prompts of 40-130 tokens through a 32-token budget, half of them
    sharing a 64-token prefix, with logprobs (and prompt logprobs where the
    prompt shares nothing); the batch runs twice, so the second time the
    shared prompts' full blocks are hits."""
    shared = seeded_prompt(7, 64)
    prompts = [
        shared + seeded_prompt(10 + i, 10 + 11 * i) if i % 2 else seeded_prompt(i, 40)
        for i in range(6)
    ]
    # Prompt logprobs need every prompt position computed: such requests do
    # not read the prefix cache, so only the shared-prefix ones omit them.
    params = [
        greedy(24, logprobs=5) if i % 2 else greedy(24, logprobs=5, prompt_logprobs=3)
        for i in range(len(prompts))
    ]
    args = {"max_num_batched_tokens": 32, "enable_prefix_caching": True}
    (v1, _), (v2, metrics) = _both(
        monkeypatch,
        llama_fp32,
        args,
        prompts,
        params,
        ("vllm:prefix_cache_hits",),
        repeat=2,
    )
    _assert_same_outputs(v1, v2, "chunked/prefix")
    assert metrics["vllm:prefix_cache_hits"] > 0, "no prefix-cache hit"


def test_preemption(monkeypatch, llama_fp32):
    """A KV cache of 320 tokens for 6 requests of 80: preempted and
    recomputed on both runners."""
    prompts = [seeded_prompt(100 + i, 40) for i in range(6)]
    args = {
        "kv_cache_memory_bytes": 320 * 2048,  # 2 KiB of KV per token here
        "max_num_batched_tokens": 64,
        "max_num_seqs": 6,
    }
    metric = ("vllm:num_preemptions",)
    (v1, m1), (v2, m2) = _both(
        monkeypatch, llama_fp32, args, prompts, greedy(40, logprobs=2), metric
    )
    _assert_same_outputs(v1, v2, "preemption")
    assert m1[metric[0]] > 0 and m2[metric[0]] > 0, "no preemption"


def test_penalties_min_p_bias_bad_words(monkeypatch, llama_fp32):
    """The sampling parameters whose kernels V2 has of its own: repetition,
    presence and frequency penalties, min_p, a logit bias and bad words, on
    greedy decoding so that tokens are comparable."""
    from vllm import SamplingParams

    prompts = [seeded_prompt(300 + i, 30 + 7 * i) for i in range(4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=3),
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            logprobs=2,
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=24,
            min_p=0.05,
            logit_bias={17: 5.0, 18: -100.0},
        ),
        SamplingParams(temperature=0.0, max_tokens=24, bad_words=["a", "the"]),
    ]
    (v1, _), (v2, _) = _both(monkeypatch, llama_fp32, {}, prompts, params)
    _assert_same_outputs(v1, v2, "sampling params")


def test_seeded_sampling_is_reproducible_on_v2(monkeypatch, llama_fp32):
    """Random sampling with a seed (temperature, top-k, top-p): on V2 the
    same seed gives the same tokens alone and batched with other requests,
    and different seeds differ; n=3 children of a seeded request are the
    same each time, and differ from each other."""
    from vllm import SamplingParams

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    vllm.envs.disable_envs_cache()
    prompt = tokens_prompt(seeded_prompt(400, 30))
    others = [tokens_prompt(seeded_prompt(401 + i, 20 + i)) for i in range(5)]

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.9, top_k=50, top_p=0.9, seed=seed, max_tokens=24
        )

    try:
        with engine(llama_fp32, "inproc", **BASE) as llm:
            alone = llm.generate([prompt], sampled(5), use_tqdm=False)
            batch = llm.generate(
                others[:2] + [prompt] + others[2:],
                [SamplingParams(temperature=1.0, max_tokens=24)] * 2
                + [sampled(5)]
                + [SamplingParams(temperature=1.0, max_tokens=24)] * 3,
                use_tqdm=False,
            )
            other_seed = llm.generate([prompt], sampled(6), use_tqdm=False)
            parallel = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=16)
            children = [
                [
                    list(c.token_ids)
                    for c in llm.generate([prompt], parallel, use_tqdm=False)[0].outputs
                ]
                for _ in range(2)
            ]
    finally:
        vllm.envs.disable_envs_cache()
    tokens = list(alone[0].outputs[0].token_ids)
    assert list(batch[2].outputs[0].token_ids) == tokens
    assert list(other_seed[0].outputs[0].token_ids) != tokens
    assert children[0] == children[1]
    assert len({tuple(c) for c in children[0]}) == 3


def test_structured_output(monkeypatch, llama_fp32):
    """A regex and a choice constraint (xgrammar bitmasks), greedy."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = [seeded_prompt(500 + i, 20) for i in range(3)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(regex="[a-e]{3,8}"),
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=10,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        ),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
    ]
    (v1, _), (v2, _) = _both(monkeypatch, llama_fp32, {}, prompts, params)
    _assert_same_outputs(v1, v2, "structured output")


SPEC_METRICS = (
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def test_ngram_speculation(monkeypatch, llama_fp32):
    """ngram speculation (3 drafts) on repetitive prompts: greedy tokens and
    logprobs as without speculation on V1, drafts proposed and accepted."""
    prompts = [repeated_prompt(600 + i, 40 + 3 * i, 5 + i % 3) for i in range(6)]
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    params = greedy(32, logprobs=2)
    (v1, _), (v2, metrics) = _both(
        monkeypatch,
        llama_fp32,
        {"speculative_config": ngram, "max_num_batched_tokens": 64},
        prompts,
        params,
        SPEC_METRICS,
    )
    _assert_same_outputs(v1, v2, "ngram")
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0


def test_eagle3_speculation(monkeypatch, llama_fp32):
    """EAGLE-3 (the tiny draft trained on the target's continuations): greedy
    tokens equal V1's, and V2 accepts drafts."""
    draft = str(build_eagle3_draft(llama_fp32))
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
    prompts = training_prompts(6)
    (v1, _), (v2, metrics) = _both(
        monkeypatch,
        llama_fp32,
        {"speculative_config": spec, "max_num_batched_tokens": 64},
        prompts,
        greedy(32),
        SPEC_METRICS,
    )
    _assert_same_outputs(v1, v2, "eagle3")
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
