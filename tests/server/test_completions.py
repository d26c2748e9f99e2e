"""`/v1/completions` through the real `openai` client, every row against HF."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from vllm_hs.hf_reference import assert_states_close
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.main_engine import HIDDEN
from vllm_hs_testing.server import (
    Collected,
    Want,
    ask,
    check,
    collect_response,
    collect_stream,
    get,
)

PROMPT = "The small cat sat by the river and looked at the"

pytestmark = [
    pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"]),
]


def complete(
    oai: Any,
    model: str,
    stream: bool,
    hidden_states: dict[str, Any] | None,
    prompt: Any = PROMPT,
    max_tokens: int = 8,
    **kwargs: Any,
) -> Collected:
    return ask(
        oai,
        model,
        stream,
        hidden_states,
        prompt=prompt,
        max_tokens=max_tokens,
        **kwargs,
    )


def test_all_layers(oai, served_model, model_dir, stream):
    got = complete(oai, served_model, stream, {})
    assert len(got.token_ids[0]) == 8
    check(model_dir, got, Want(), "completion all layers", stream=stream)


def test_explicit_base64_and_layer_order(oai, served_model, model_dir, stream):
    """A subset comes back in the request's order (not the server's)."""
    hs = {"layers": ["final_norm", 2], "encoding": "base64"}
    got = complete(oai, served_model, stream, hs, prompt=seeded_prompt(11, 37))
    assert got.prompt_ids[0] == seeded_prompt(11, 37)
    check(model_dir, got, Want(["final_norm", 2]), "completion subset", stream=stream)


def test_minus_one_is_last_layer(oai, served_model, model_dir, stream):
    got = complete(oai, served_model, stream, {"layers": [-1, 0]}, max_tokens=5)
    check(model_dir, got, Want([-1, 0]), "completion [-1, 0]", stream=stream)


def test_prompt_false(oai, served_model, model_dir, stream):
    got = complete(oai, served_model, stream, {"prompt": False, "layers": [2]})
    check(model_dir, got, Want([2], prompt=False), "prompt=false", stream=stream)


def test_output_false(oai, served_model, model_dir, stream):
    got = complete(oai, served_model, stream, {"output": False})
    check(model_dir, got, Want(output=False), "output=false", stream=stream)


def test_without_hidden_states(oai, served_model, model_dir, stream):
    got = complete(oai, served_model, stream, None)
    check(model_dir, got, None, "no hidden_states", stream=stream)


def test_n2_prompt_once(oai, served_model, model_dir, stream):
    """n=2: prompt states once (first choice), output states per choice."""
    got = complete(
        oai,
        served_model,
        stream,
        {"layers": [0, "final_norm"]},
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=6,
    )
    assert got.token_ids[0] != got.token_ids[1], "choices should differ (seeded)"
    check(model_dir, got, Want([0, "final_norm"]), "n=2", n=2, stream=stream)


def test_max_tokens_1(oai, served_model, model_dir, stream):
    """One generated token: prefill-only extraction, output rows [0, K, H]."""
    got = complete(oai, served_model, stream, {}, max_tokens=1)
    assert len(got.token_ids[0]) == 1
    if not stream:
        shape = get(got.payloads[-1][2], "shape")
        kinds = [(kind, index) for kind, index, _ in got.payloads]
        assert kinds == [("prompt", 0), ("output", 0)], kinds
        assert shape == [0, 4, HIDDEN]
        assert got.states.output(0).shape == (0, 4, HIDDEN)
        assert got.states.output(0).dtype == torch.float32
    else:
        # A stream has nothing to send for zero rows: prompt states only.
        assert [kind for kind, _, _ in got.payloads] == ["prompt"]
    check(model_dir, got, Want(), "max_tokens=1", stream=stream)


def test_two_prompts_n2(oai, served_model, model_dir, stream):
    """A batch of 2 prompts x n=2: choices 0-1 belong to prompt 0, 2-3 to
    prompt 1; prompt states come on the first choice of each prompt."""
    prompts = [seeded_prompt(21, 9), seeded_prompt(22, 30)]
    got = complete(
        oai,
        served_model,
        stream,
        {"layers": [2, -1]},
        prompt=prompts,
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=4,
    )
    assert sorted(got.token_ids) == [0, 1, 2, 3]
    assert sorted(got.states.prompts) == [0, 2], sorted(got.states.prompts)
    for first in (0, 2):
        sub = Collected(chat=False)
        for k in (first, first + 1):
            sub.token_ids[k - first] = got.token_ids[k]
            sub.prompt_ids[k - first] = got.prompt_ids[k]
            if got.states.output(k) is not None:
                sub.states.outputs[k - first] = got.states.output(k)
            sub.finish[k - first] = got.finish.get(k)
        sub.states.prompts[0] = got.states.prompt(first)
        sub.payloads = [
            (kind, index - first, p)
            for kind, index, p in got.payloads
            if first <= index <= first + 1
        ]
        sub.rows_vs_tokens = [
            (index - first, r, t)
            for index, r, t in got.rows_vs_tokens
            if first <= index <= first + 1
        ]
        sub.prompt_chunk = {0: got.prompt_chunk.get(first)}
        assert sub.prompt_ids[0] == prompts[first // 2]
        check(model_dir, sub, Want([2, -1]), f"prompt {first // 2}", n=2, stream=stream)


def test_n4_prompt_states_once(oai, served_model, model_dir, stream):
    """n=4, 4 requests at once: in a stream the children's first tokens often
    reach the server together (one merged RequestOutput); prompt states must
    still come once per prompt, on choice 0."""

    def one(attempt: int) -> Collected:
        return complete(
            oai,
            served_model,
            stream,
            {"layers": ["final_norm"]},
            prompt=seeded_prompt(40 + attempt, 20),
            n=4,
            temperature=1.0,
            seed=attempt,
            max_tokens=3,
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    sent = [[i for kind, i, _ in got.payloads if kind == "prompt"] for got in results]
    assert sent == [[0]] * 4, f"prompt states on choices, per request: {sent}"
    for attempt, got in enumerate(results):
        check(
            model_dir, got, Want(["final_norm"]), f"n=4 #{attempt}", n=4, stream=stream
        )


@pytest.mark.parametrize(
    "positions", ["last", [[3, 6], [14, 17]]], ids=["last", "windows"]
)
def test_positions(oai, served_model, model_dir, stream, positions):
    """`positions` over HTTP: payloads hold the selected rows and list their
    positions; streamed, the "last" output row comes in the final chunk."""
    from vllm_hs_testing.server import reference

    prompt = seeded_prompt(12, 15)
    hs = {"layers": [0, "final_norm"], "positions": positions}
    got = complete(oai, served_model, stream, hs, prompt=prompt, max_tokens=6)
    tokens = got.token_ids[0]
    assert len(tokens) == 6
    ref_prompt, ref_output = reference(model_dir, prompt, tokens, [0, "final_norm"])
    if positions == "last":
        want_prompt, want_output = [14], [15 + 6 - 2]
    else:
        want_prompt, want_output = [3, 4, 5, 14], [15, 16]
    assert got.states.prompt_positions[0] == want_prompt
    assert got.states.output_positions[0] == want_output
    for rows, ref, what in (
        (got.states.prompt(0), ref_prompt[want_prompt], "prompt"),
        (got.states.output(0), ref_output[[p - 15 for p in want_output]], "output"),
    ):
        assert_states_close(
            rows, ref, dtype=torch.float32, what=f"{positions} {what}", layers=[0, 1]
        )
    if stream and positions == "last":
        # No output rows before the last chunk that carries tokens (a slow
        # consumer may get several tokens in one chunk: vLLM merges deltas).
        counts = [rows for _, rows, _ in got.rows_vs_tokens]
        assert counts[-1] == 1 and not any(counts[:-1]), counts


def test_rows_without_return_token_ids(oai, served_model, model_dir, stream):
    """A request that asks for hidden states but no token ids gets every row.
    (vLLM 0.34.0 renders plain streamed chunks from a template, which would
    skip the rows; its series keeps such requests off that path.) The tokens
    come from the same greedy request with token ids; the rows from HF."""
    from vllm_hs_testing.server import reference

    prompt = seeded_prompt(13, 15)
    tokens = complete(oai, served_model, False, None, prompt=prompt).token_ids[0]
    response = oai.completions.create(
        model=served_model,
        prompt=prompt,
        max_tokens=len(tokens),
        stream=stream,
        temperature=0.0,
        extra_body={"ignore_eos": True, "hidden_states": {"layers": [0, -1]}},
    )
    got = (collect_stream if stream else collect_response)(response, chat=False)
    assert got.token_ids.get(0, []) == []  # none asked for
    ref_prompt, ref_output = reference(model_dir, prompt, tokens, [0, -1])
    for rows, ref, what in (
        (got.states.prompt(0), ref_prompt, "prompt"),
        (got.states.output(0), ref_output, "output"),
    ):
        assert rows is not None, what
        assert_states_close(rows, ref, dtype=torch.float32, what=what, layers=[0, -1])
