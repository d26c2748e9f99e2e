"""The hidden-state channel on one engine per mode, every row against HF."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from vllm_hs.hf_reference import hf_greedy
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import worker_request_ids
from vllm_hs_testing.hf_checks import (
    Expect,
    check_output,
    rejected_then_served,
    run_cases,
)
from vllm_hs_testing.main_engine import BUDGET, MAIN_RESOLVED, PREFIX_STORE_BLOCKS
from vllm_hs_testing.requests import greedy, tokens_prompt

DTYPE = torch.float32


def test_mixed_batch(main_engine, llama_fp32):
    """With and without states, different layer subsets and lengths, one batch."""
    llm, mode = main_engine
    cases = [
        (seeded_prompt(1, 20), greedy(6, hidden_states={}), Expect(MAIN_RESOLVED)),
        (seeded_prompt(2, 13), greedy(6), None),
        (
            seeded_prompt(3, 40),
            greedy(5, hidden_states={"layers": ["final_norm", 2], "prompt": False}),
            Expect(["final_norm", 2], prompt=False),
        ),
        (
            seeded_prompt(4, 7),
            greedy(3, hidden_states={"layers": [-1, 0], "output": False}),
            Expect([4, 0], output=False),
        ),
        (seeded_prompt(5, 120), greedy(4, hidden_states={"layers": [0]}), Expect([0])),
    ]
    outputs = run_cases(llm, cases, llama_fp32, DTYPE, f"[{mode}] request")
    for i, (out, (prompt, sp, expect)) in enumerate(zip(outputs, cases, strict=True)):
        assert list(out.outputs[0].token_ids) == hf_greedy(
            llama_fp32, prompt, sp.max_tokens
        ), f"[{mode}] request {i}: tokens differ from HF greedy"
        if expect is not None and expect.prompt:
            assert out.prompt_hidden_states.shape == (
                len(prompt),
                len(expect.layers),
                128,
            )


def test_chunked_prefill(main_engine, llama_fp32):
    """A prompt split over at least three prefill steps."""
    llm, mode = main_engine
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == BUDGET
    prompt = seeded_prompt(6, 5 * BUDGET - 3)
    assert len(prompt) > 3 * BUDGET
    (out,) = llm.generate(
        [tokens_prompt(prompt)], greedy(8, hidden_states={}), use_tqdm=False
    )
    check_output(out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] chunked")


def test_rows_handed_out_outlive_the_next_batch(main_engine, llama_fp32):
    """The worker stages a step's rows in host buffers that it reuses once
    nothing views them: rows handed out own their memory (no view of a step's
    rows), and the next batch, of the same shape and so the same buffer sizes,
    leaves them as they were."""
    llm, mode = main_engine
    sp = greedy(3, hidden_states={})
    first = [seeded_prompt(60 + i, 24) for i in range(3)]
    kept = llm.generate([tokens_prompt(p) for p in first], sp, use_tqdm=False)
    before = [
        (o.prompt_hidden_states.clone(), o.outputs[0].hidden_states.clone())
        for o in kept
    ]
    second = [seeded_prompt(70 + i, 24) for i in range(3)]
    llm.generate([tokens_prompt(p) for p in second], sp, use_tqdm=False)
    for i, (out, (prompt_rows, output_rows)) in enumerate(
        zip(kept, before, strict=True)
    ):
        for rows in (out.prompt_hidden_states, out.outputs[0].hidden_states):
            assert rows.untyped_storage().nbytes() == rows.nbytes, (
                f"[{mode}] request {i}: its rows view a larger tensor"
            )
        assert torch.equal(out.prompt_hidden_states, prompt_rows)
        assert torch.equal(out.outputs[0].hidden_states, output_rows)
        check_output(
            out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] kept {i}"
        )


def test_prefix_caching(main_engine, llama_fp32):
    """Shared prefixes and a repeated prompt: never short. A prompt-state
    request uses a prefix-cache hit when the engine holds the hit's rows
    (published by an earlier request that captured them, any superset of its
    layers) and recomputes otherwise (plain traffic stores no rows; evicted
    rows); output-only requests always keep the hit."""
    llm, mode = main_engine
    prefix = seeded_prompt(10, 64)  # two full 32-token blocks
    first = prefix + seeded_prompt(11, 10)
    (warm,) = llm.generate([tokens_prompt(first)], greedy(4), use_tqdm=False)
    check_output(warm, llama_fp32, None, DTYPE, f"[{mode}] warm-up")

    def states(prompt, expect, **hs):
        (out,) = llm.generate(
            [tokens_prompt(prompt)], greedy(4, hidden_states=hs), use_tqdm=False
        )
        check_output(out, llama_fp32, expect, DTYPE, f"[{mode}] {prompt[64:67]}")
        return out.num_cached_tokens

    # KV of the prefix is cached, its rows are not (the warm-up asked none).
    assert states(prefix + seeded_prompt(12, 9), Expect(MAIN_RESOLVED)) == 0
    # Now they are: a hit, served from the store, in another layer order.
    layers = ["final_norm", 2]
    assert states(prefix + seeded_prompt(13, 9), Expect(layers), layers=layers) == 64

    output_only = prefix + seeded_prompt(14, 9)
    (out,) = llm.generate(
        [tokens_prompt(output_only)],
        greedy(6, hidden_states={"prompt": False}),
        use_tqdm=False,
    )
    assert out.num_cached_tokens >= 32, "output-only request lost the prefix cache"
    check_output(
        out,
        llama_fp32,
        Expect(MAIN_RESOLVED, prompt=False),
        DTYPE,
        f"[{mode}] output-only over cached prefix",
    )

    # Rows of PREFIX_STORE_BLOCKS other blocks evict the prefix's rows (the KV
    # cache still holds its KV): the next hit is refused and recomputed.
    for k in range(PREFIX_STORE_BLOCKS // 2):
        states(seeded_prompt(20 + k, 64) + [9, 10], Expect(MAIN_RESOLVED))
    assert states(prefix + seeded_prompt(15, 9), Expect(MAIN_RESOLVED)) == 0
    # ... and stored again by that recompute.
    for k in range(2):
        assert states(first, Expect(MAIN_RESOLVED)) == 64, k
    (plain,) = llm.generate([tokens_prompt(first)], greedy(2), use_tqdm=False)
    assert plain.num_cached_tokens > 0, "prefix caching is not active in this engine"


def test_n_greater_than_one(main_engine, llama_fp32):
    """Prompt states once; each completion its own output states."""
    from vllm import SamplingParams

    llm, mode = main_engine
    prompt = seeded_prompt(20, 24)
    # No per-request seed: on CPU a seeded request whose prefill is chunked
    # crashes upstream vLLM 0.32.0 ("CPU Generator does not use offset").
    sp = SamplingParams(
        n=3, temperature=1.0, max_tokens=8, ignore_eos=True, hidden_states={}
    )
    (out,) = llm.generate([tokens_prompt(prompt)], sp, use_tqdm=False)
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples identical"
    assert out.prompt_hidden_states.shape[0] == len(prompt)
    check_output(out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] n=3")


def test_stop_token(main_engine, llama_fp32):
    llm, mode = main_engine
    prompt = seeded_prompt(30, 18)
    reference = hf_greedy(llama_fp32, prompt, 16)
    k = next(i for i in range(4, 16) if reference[i] not in reference[:i])
    (out,) = llm.generate(
        [tokens_prompt(prompt)],
        greedy(16, stop_token_ids=[reference[k]], hidden_states={}),
        use_tqdm=False,
    )
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert list(completion.token_ids)[:k] == reference[:k]
    assert len(completion.token_ids) <= k + 1
    check_output(out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] stop token")


def first_new_trigram(text: str) -> str:
    """A 3-character stop string that first occurs in the second half of
    `text`: generation stops there, mid-way."""
    return next(
        text[i : i + 3]
        for i in range(len(text) // 2, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )


def test_stop_string(main_engine, llama_fp32):
    """Rows are trimmed with the tokens when a stop string ends the text."""
    llm, mode = main_engine
    prompt = seeded_prompt(31, 18)
    (full,) = llm.generate([tokens_prompt(prompt)], greedy(20), use_tqdm=False)
    text = full.outputs[0].text
    assert len(text) > 12, f"degenerate text {text!r}"
    stop = first_new_trigram(text)
    (out,) = llm.generate(
        [tokens_prompt(prompt)],
        greedy(20, stop=[stop], hidden_states={}),
        use_tqdm=False,
    )
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < 20
    check_output(out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] stop string")


def test_max_tokens_one_is_prefill_only(main_engine, llama_fp32):
    llm, mode = main_engine
    prompt = seeded_prompt(40, 50)
    (out,) = llm.generate(
        [tokens_prompt(prompt)], greedy(1, hidden_states={}), use_tqdm=False
    )
    rows = out.outputs[0].hidden_states
    assert rows is not None and rows.shape == (0, len(MAIN_RESOLVED), 128)
    check_output(
        out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] max_tokens=1"
    )


def test_requests_without_states_match_hf(main_engine, llama_fp32):
    llm, mode = main_engine
    prompts = [seeded_prompt(50 + i, 10 + 7 * i) for i in range(4)]
    outs = llm.generate([tokens_prompt(p) for p in prompts], greedy(10), use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert out.prompt_hidden_states is None
        assert out.outputs[0].hidden_states is None
        assert list(out.outputs[0].token_ids) == hf_greedy(llama_fp32, p, 10)


@pytest.mark.parametrize(
    ("hidden_states", "match"),
    [
        ({"layers": [3]}, "not captured by this engine"),
        ({"layers": [9]}, "out of range"),
        ({"layers": ["norm"]}, "Invalid hidden-state layer id"),
        ({"layers": "0"}, "must be a list"),
        ({"layers": []}, "must not be empty"),
        ({"layers": [0, 0]}, "duplicates"),
        ({"prompt": False, "output": False}, "neither prompt nor output"),
        ({"prompt": "yes"}, "must be a bool"),
        ({"foo": 1}, "Unknown hidden_states fields"),
        (42, "must be HiddenStatesParams"),
    ],
)
def test_bad_request_is_rejected_and_engine_serves_on(
    main_engine, llama_fp32, hidden_states, match
):
    rejected_then_served(
        main_engine, llama_fp32, seeded_prompt(60, 12), hidden_states, match, {}
    )


def test_payload_over_cap_is_rejected(main_engine, llama_fp32):
    """Cap = 256 rows: 200 prompt rows + 99 output rows exceed it."""
    llm, mode = main_engine
    prompt = seeded_prompt(61, 200)
    with pytest.raises(ValueError, match="over the engine's cap"):
        llm.generate([tokens_prompt(prompt)], greedy(100, hidden_states={}))
    # The same request without prompt states, or shorter, fits.
    (out,) = llm.generate(
        [tokens_prompt(prompt)],
        greedy(4, hidden_states={"prompt": False}),
        use_tqdm=False,
    )
    check_output(
        out, llama_fp32, Expect(MAIN_RESOLVED, prompt=False), DTYPE, f"[{mode}] cap"
    )


def test_states_on_a_pooling_request_are_rejected(main_engine):
    from vllm import PoolingParams

    llm, mode = main_engine
    with pytest.raises(ValueError, match="not available on pooling requests"):
        llm.llm_engine.add_request(
            f"pool-{mode}",
            tokens_prompt(seeded_prompt(62, 8)),
            PoolingParams(extra_kwargs={"hidden_states": {}}),
        )
    assert not llm.llm_engine.has_unfinished_requests()


def _rss_bytes(mode: str) -> int:
    me = psutil.Process(os.getpid())
    procs = [me] + (me.children(recursive=True) if mode == "mp" else [])
    return sum(p.memory_info().rss for p in procs)


def test_aborts_leave_nothing_behind(main_engine, llama_fp32):
    """A few hundred requests aborted mid-flight with rows in transit: nothing
    is left in the frontend, the scheduler or the worker (the step that reports
    the aborts schedules no tokens), memory stays flat, and the next request is
    served correctly."""
    llm, mode = main_engine
    llm_engine = llm.llm_engine
    rss: list[int] = []
    for round_ in range(4):
        ids = [f"abort-{round_}-{i}" for i in range(80)]
        for i, req_id in enumerate(ids):
            llm_engine.add_request(
                req_id,
                tokens_prompt(seeded_prompt(1000 + i, 100)),
                greedy(50, hidden_states={}),
            )
        for _ in range(12):  # mid-prefill and early decode, rows accumulated
            llm_engine.step()
        llm_engine.abort_request(ids)
        while llm_engine.has_unfinished_requests():
            llm_engine.step()
        assert llm_engine.get_num_unfinished_requests() == 0
        assert not llm_engine.output_processor.request_states
        if mode == "inproc":
            scheduler = llm_engine.engine_core.engine_core.scheduler
            assert not scheduler.requests, "scheduler kept aborted requests"
        assert worker_request_ids(llm, mode) == [], "worker kept aborted requests"
        rss.append(_rss_bytes(mode))
    # 80 requests x 100 prompt rows x 2 KiB = 16 MiB per round if leaked.
    growth = rss[-1] - rss[1]
    assert growth < 12 << 20, f"[{mode}] memory grew {growth / 2**20:.1f} MiB: {rss}"
    prompt = seeded_prompt(1500, 30)
    (out,) = llm.generate(
        [tokens_prompt(prompt)], greedy(5, hidden_states={}), use_tqdm=False
    )
    check_output(
        out, llama_fp32, Expect(MAIN_RESOLVED), DTYPE, f"[{mode}] after aborts"
    )
    assert worker_request_ids(llm, mode) == [], "worker kept a finished request"


def test_n_children_keep_skip_reading_prefix_cache(main_engine):
    """n>1: only the first child computes prompt states, and a user's
    skip_reading_prefix_cache holds for every child as set (prompt states do
    not force a skip: rows of a hit come from the AuxOutput store)."""
    from vllm import SamplingParams

    llm, mode = main_engine
    if mode != "inproc":
        pytest.skip("reads the scheduler's requests: in-process engine only")
    llm_engine = llm.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    expected = {True: [True, True, True], None: [False, False, False]}
    for user_value, skips in expected.items():
        params = SamplingParams(
            n=3,
            temperature=1.0,
            max_tokens=4,
            hidden_states={},
            skip_reading_prefix_cache=user_value,
        )
        parent = f"skip-{user_value}"
        llm_engine.add_request(parent, tokens_prompt(seeded_prompt(70, 40)), params)
        children = sorted(
            (r for r in scheduler.requests.values() if parent in r.request_id),
            key=lambda r: r.request_id,
        )
        assert [r.skip_reading_prefix_cache for r in children] == skips, user_value
        assert [r.sampling_params.skip_reading_prefix_cache for r in children] == [
            bool(user_value)
        ] * 3, "the user's setting was overwritten"
        while llm_engine.has_unfinished_requests():
            llm_engine.step()


# --- positions: the last row, or windows --------------------------------------


def test_positions_in_a_mixed_batch(main_engine, llama_fp32):
    """Positions "last" and windows next to all-row and plain requests, over chunked
    prefills: each row is the HF row of the position the output names."""
    llm, mode = main_engine
    long = 3 * BUDGET + 5  # prefilled over four steps
    cases = [
        (
            seeded_prompt(70, 20),
            greedy(6, hidden_states={"positions": "last"}),
            Expect(MAIN_RESOLVED, positions="last"),
        ),
        (
            seeded_prompt(71, long),
            # Windows across chunk boundaries and the prompt's end.
            greedy(7, hidden_states={"positions": [[30, 35], [long - 2, long + 3]]}),
            Expect(MAIN_RESOLVED, positions=[[30, 35], [long - 2, long + 3]]),
        ),
        (seeded_prompt(72, 13), greedy(5, hidden_states={}), Expect(MAIN_RESOLVED)),
        (seeded_prompt(73, 9), greedy(5), None),
        (
            seeded_prompt(74, long),
            greedy(4, hidden_states={"layers": ["final_norm", 0], "positions": "last"}),
            Expect(["final_norm", 0], positions="last"),
        ),
        (
            seeded_prompt(75, 17),
            greedy(6, hidden_states={"positions": "last", "prompt": False}),
            Expect(MAIN_RESOLVED, prompt=False, positions="last"),
        ),
        (
            seeded_prompt(76, 11),
            greedy(1, hidden_states={"positions": "last"}),  # G=1: no output row
            Expect(MAIN_RESOLVED, positions="last"),
        ),
    ]
    outputs = run_cases(llm, cases, llama_fp32, DTYPE, f"[{mode}] positions")
    last = outputs[0]
    assert last.prompt_hidden_states.shape == (1, len(MAIN_RESOLVED), 128)
    assert last.prompt_hidden_states_positions == [19]
    assert last.outputs[0].hidden_states_positions == [20 + 6 - 2]
    assert outputs[6].outputs[0].hidden_states.shape == (0, len(MAIN_RESOLVED), 128)
    assert outputs[2].prompt_hidden_states_positions is None  # all rows


def test_positions_last_keeps_the_prefix_cache_hit(main_engine, llama_fp32):
    """A "last" request reads the whole prefix-cache hit (its one prompt row
    is always computed); a window inside the cached prefix (whose rows no
    request published) caps the hit before the window: the blocks below
    position 40 are still read, the rest is recomputed."""
    llm, mode = main_engine
    prompt = seeded_prompt(77, 70)
    llm.generate([tokens_prompt(prompt)], greedy(2), use_tqdm=False)
    (full,) = llm.generate([tokens_prompt(prompt)], greedy(2), use_tqdm=False)
    assert full.num_cached_tokens > 40
    for positions, cached in (("last", range(41, 70)), ([[40, 45]], range(1, 41))):
        (out,) = llm.generate(
            [tokens_prompt(prompt)],
            greedy(5, hidden_states={"positions": positions}),
            use_tqdm=False,
        )
        assert out.num_cached_tokens in cached, (positions, out.num_cached_tokens)
        check_output(
            out,
            llama_fp32,
            Expect(MAIN_RESOLVED, positions=positions),
            DTYPE,
            f"[{mode}] {positions} over a cached prefix",
        )


def test_positions_last_with_a_stop_string_and_n(main_engine, llama_fp32):
    """The frontend ends a stop-string request: the last row is still that
    of the completion's last token; with n=2 each completion has its own."""
    from vllm import SamplingParams

    llm, mode = main_engine
    prompt = seeded_prompt(31, 18)  # test_stop_string's prompt
    (full,) = llm.generate([tokens_prompt(prompt)], greedy(20), use_tqdm=False)
    text = full.outputs[0].text
    stop = first_new_trigram(text)
    (out,) = llm.generate(
        [tokens_prompt(prompt)],
        greedy(20, stop=[stop], hidden_states={"positions": "last"}),
        use_tqdm=False,
    )
    assert out.outputs[0].stop_reason == stop and len(out.outputs[0].token_ids) < 20
    check_output(
        out,
        llama_fp32,
        Expect(MAIN_RESOLVED, positions="last"),
        DTYPE,
        f"[{mode}] last, stop string",
    )
    sp = SamplingParams(
        n=2,
        temperature=1.0,
        max_tokens=6,
        ignore_eos=True,
        hidden_states={"positions": [[10, 12], [20, 23]]},
    )
    (out,) = llm.generate([tokens_prompt(seeded_prompt(78, 19))], sp, use_tqdm=False)
    assert len(out.outputs) == 2
    check_output(
        out,
        llama_fp32,
        Expect(MAIN_RESOLVED, positions=[[10, 12], [20, 23]]),
        DTYPE,
        f"[{mode}] windows, n=2",
    )


@pytest.mark.parametrize(
    ("hidden_states", "match"),
    [
        ({"positions": "first"}, "positions"),
        ({"positions": [[5, 5]]}, "0 <= start < end"),
        ({"positions": [[0, 4]], "prompt": False}, "selects no position"),
        ({"positions": [[100, 200]]}, "selects no position"),
    ],
)
def test_bad_positions_are_rejected_and_engine_serves_on(
    main_engine, llama_fp32, hidden_states, match
):
    rejected_then_served(
        main_engine,
        llama_fp32,
        seeded_prompt(79, 12),
        hidden_states,
        match,
        {"positions": [[11, 13]]},
    )


def test_cap_counts_only_selected_rows(main_engine, llama_fp32):
    """Cap = 256 rows: all rows of this request exceed it, its last rows or a
    small window do not."""
    llm, mode = main_engine
    prompt = seeded_prompt(61, 200)
    with pytest.raises(ValueError, match="over the engine's cap"):
        llm.generate([tokens_prompt(prompt)], greedy(100, hidden_states={}))
    for positions in ("last", [[190, 210]]):
        (out,) = llm.generate(
            [tokens_prompt(prompt)],
            greedy(100, hidden_states={"positions": positions}),
            use_tqdm=False,
        )
        check_output(
            out,
            llama_fp32,
            Expect(MAIN_RESOLVED, positions=positions),
            DTYPE,
            f"[{mode}] {positions} under the cap",
        )
