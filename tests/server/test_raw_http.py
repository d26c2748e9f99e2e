"""Raw HTTP (httpx) on both endpoints: the JSON payload fields, `float` vs
`base64`, and SSE streams parsed with `vllm_hs.client.sse_events`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_hs.client import decode
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.main_engine import HIDDEN, MAIN_RESOLVED
from vllm_hs_testing.server import (
    Collected,
    Want,
    check,
    collect_response,
    collect_stream,
    sse_chunks,
)

PROMPT_IDS = seeded_prompt(101, 23)
MESSAGES = [{"role": "user", "content": "Write a tiny story about a blue dog."}]

ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": PROMPT_IDS}),
    "chat": ("/v1/chat/completions", {"messages": MESSAGES}),
}


def body(
    model: str, endpoint: str, hidden_states: dict[str, Any] | None, **kwargs: Any
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        **ENDPOINTS[endpoint][1],
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if hidden_states is not None:
        payload["hidden_states"] = hidden_states
    payload.update(kwargs)
    return payload


def post(http: Any, model: str, endpoint: str, hs: dict[str, Any] | None) -> Any:
    response = http.post(ENDPOINTS[endpoint][0], json=body(model, endpoint, hs))
    assert response.status_code == 200, response.text[:2000]
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def stream(http: Any, model: str, endpoint: str, hs: dict[str, Any]) -> Collected:
    with http.stream(
        "POST", ENDPOINTS[endpoint][0], json=body(model, endpoint, hs, stream=True)
    ) as response:
        if response.status_code != 200:
            response.read()
            raise AssertionError(f"HTTP {response.status_code}: {response.text[:2000]}")
        assert response.headers["content-type"].startswith("text/event-stream")
        return collect_stream(list(sse_chunks(response)), chat=endpoint == "chat")


def payloads_of(data: dict[str, Any], endpoint: str) -> tuple[dict, dict]:
    """(prompt payload, output payload of choice 0) of a non-streamed JSON."""
    choice = data["choices"][0]
    if endpoint == "chat":
        assert (
            "prompt_hidden_states" not in choice
            or choice["prompt_hidden_states"] is None
        )
        return data["prompt_hidden_states"], choice["hidden_states"]
    assert data.get("prompt_hidden_states") is None
    return choice["prompt_hidden_states"], choice["hidden_states"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_payload_fields(http, served_model, model_dir, endpoint):
    """layers null = the server's set with -1 shown as 4; dtype; shape; data."""
    data = post(http, served_model, endpoint, {})
    prompt, output = payloads_of(data, endpoint)
    got = collect_response(data, chat=endpoint == "chat")
    num_prompt = len(got.prompt_ids[0])
    for payload, rows in ((prompt, num_prompt), (output, 5)):
        assert set(payload) == {"layers", "shape", "dtype", "encoding", "data"}
        assert payload["layers"] == MAIN_RESOLVED == [0, 2, 4, "final_norm"]
        assert payload["dtype"] == "float32"
        assert payload["encoding"] == "base64"
        assert payload["shape"] == [rows, 4, HIDDEN]
        assert isinstance(payload["data"], str)
        assert len(payload["data"]) == 4 * ((rows * 4 * HIDDEN * 4 + 2) // 3)
    check(model_dir, got, Want(), f"raw {endpoint}")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_float_equals_base64(http, served_model, model_dir, endpoint):
    """The same greedy request in both encodings decodes to the same tensor."""
    hs = {"layers": [-1, "final_norm", 0]}
    b64 = post(http, served_model, endpoint, {**hs, "encoding": "base64"})
    flt = post(http, served_model, endpoint, {**hs, "encoding": "float"})
    got_b64 = collect_response(b64, chat=endpoint == "chat")
    got_flt = collect_response(flt, chat=endpoint == "chat")
    assert got_b64.token_ids == got_flt.token_ids
    assert got_b64.prompt_ids == got_flt.prompt_ids
    pairs = zip(payloads_of(b64, endpoint), payloads_of(flt, endpoint), strict=True)
    for a, b in pairs:
        assert b["encoding"] == "float"
        assert b["layers"] == a["layers"] == [4, "final_norm", 0]
        assert b["shape"] == a["shape"] and b["dtype"] == a["dtype"] == "float32"
        nested = b["data"]
        assert isinstance(nested, list)
        assert [len(nested), len(nested[0]), len(nested[0][0])] == b["shape"]
        ta, tb = decode(a), decode(b)
        assert ta.dtype == tb.dtype == torch.float32
        assert torch.equal(ta, tb), (ta - tb).abs().max()
    check(model_dir, got_flt, Want([-1, "final_norm", 0]), f"raw {endpoint} float")
    check(model_dir, got_b64, Want([-1, "final_norm", 0]), f"raw {endpoint} base64")


@pytest.mark.parametrize("encoding", ["base64", "float"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_sse_stream(http, served_model, model_dir, endpoint, encoding):
    hs = {"layers": [2, "final_norm"], "encoding": encoding}
    got = stream(http, served_model, endpoint, hs)
    assert got.num_chunks >= 6
    for kind, _, payload in got.payloads:
        assert payload["encoding"] == encoding, kind
        assert isinstance(payload["data"], str if encoding == "base64" else list)
        if kind == "output":
            assert payload["shape"][0] >= 1, "empty output payload in a stream"
    check(model_dir, got, Want([2, "final_norm"]), f"sse {endpoint}", stream=True)
    # The concatenated deltas equal the non-streamed tensors.
    full = collect_response(
        post(http, served_model, endpoint, hs), chat=endpoint == "chat"
    )
    assert full.token_ids == got.token_ids
    assert torch.equal(full.states.prompt(0), got.states.prompt(0))
    assert torch.equal(full.states.output(0), got.states.output(0))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_no_states_unless_asked(http, served_model, endpoint):
    data = post(http, served_model, endpoint, None)
    assert data.get("prompt_hidden_states") is None
    for choice in data["choices"]:
        assert choice.get("hidden_states") is None
        assert choice.get("prompt_hidden_states") is None
