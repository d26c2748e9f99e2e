"""`/v1/chat/completions` through the real `openai` client, every row against HF.

The prompt states are those of the chat-templated prompt: the reference runs on
the `prompt_token_ids` the server returns, which are checked against the
model's own chat template first."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from vllm_hs_testing.server import (
    Collected,
    Want,
    ask,
    check,
)

MESSAGES = [
    {"role": "system", "content": "You are a tiny test model."},
    {"role": "user", "content": "Tell me a small story about a red cat."},
]

pytestmark = pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])


@functools.cache
def templated(model_dir: str, key: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = MESSAGES if key == "default" else MESSAGES[1:]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def chat(
    oai: Any,
    model: str,
    stream: bool,
    hidden_states: dict[str, Any] | None,
    messages: list[dict[str, str]] = MESSAGES,
    max_tokens: int = 7,
    **kwargs: Any,
) -> Collected:
    return ask(
        oai,
        model,
        stream,
        hidden_states,
        messages=messages,
        max_tokens=max_tokens,
        **kwargs,
    )


def test_all_layers(oai, served_model, model_dir, stream):
    got = chat(oai, served_model, stream, {})
    assert got.prompt_ids[0] == templated(model_dir, "default")
    assert len(got.token_ids[0]) == 7
    check(model_dir, got, Want(), "chat all layers", stream=stream)


def test_layer_subset_in_request_order(oai, served_model, model_dir, stream):
    got = chat(
        oai, served_model, stream, {"layers": ["final_norm", 2]}, messages=MESSAGES[1:]
    )
    assert got.prompt_ids[0] == templated(model_dir, "user-only")
    check(model_dir, got, Want(["final_norm", 2]), "chat subset", stream=stream)


def test_prompt_false(oai, served_model, model_dir, stream):
    got = chat(oai, served_model, stream, {"prompt": False, "layers": [-1]})
    check(model_dir, got, Want([-1], prompt=False), "chat prompt=false", stream=stream)


def test_output_false(oai, served_model, model_dir, stream):
    got = chat(oai, served_model, stream, {"output": False, "layers": [0]})
    check(model_dir, got, Want([0], output=False), "chat output=false", stream=stream)


def test_without_hidden_states(oai, served_model, model_dir, stream):
    got = chat(oai, served_model, stream, None)
    check(model_dir, got, None, "chat without hidden_states", stream=stream)


def test_max_tokens_1(oai, served_model, model_dir, stream):
    got = chat(oai, served_model, stream, {"layers": [2]}, max_tokens=1)
    if not stream:
        assert got.states.output(0).shape == (0, 1, 128)
    check(model_dir, got, Want([2]), "chat max_tokens=1", stream=stream)


def test_n4_prompt_states_once(oai, served_model, model_dir, stream):
    """Chat has one response-level prompt_hidden_states; in a stream it must
    come in exactly one chunk, also when the choices' first tokens reach the
    server together (one merged RequestOutput; likely with a few requests in
    flight). Otherwise `vllm_hs.client` concatenates the copies."""

    def one(attempt: int) -> Collected:
        return chat(
            oai,
            served_model,
            stream,
            {"layers": [0, "final_norm"]},
            messages=[{"role": "user", "content": f"Tell me story number {attempt}."}],
            n=4,
            temperature=1.0,
            seed=attempt,
            max_tokens=3,
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    counts = [
        len([kind for kind, _, _ in got.payloads if kind == "prompt"])
        for got in results
    ]
    assert counts == [1] * 4, f"prompt_hidden_states payloads per request: {counts}"
    for attempt, got in enumerate(results):
        check(
            model_dir,
            got,
            Want([0, "final_norm"]),
            f"chat n=4 #{attempt}",
            n=4,
            stream=stream,
        )
