"""Bad hidden-state requests: HTTP 400 with a clear message, also when
streaming (a 400 status, not an error event in a 200 stream), and the server
keeps serving right answers afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.main_engine import CAP_BYTES
from vllm_hs_testing.server import Want, check, collect_response

LONG_PROMPT = seeded_prompt(77, 200)
LONG_MESSAGE = " ".join(["the red cat sat"] * 60)  # ~240 tokens templated

# name -> (hidden_states, words the error message must contain, other overrides)
BAD: dict[str, tuple[Any, list[str], dict[str, Any]]] = {
    "layer_not_captured": ({"layers": [3]}, ["3", "not captured", "[0, 2, 4"], {}),
    "layer_out_of_range": ({"layers": [0, 9]}, ["9", "out of range"], {}),
    "layer_negative": ({"layers": [-2]}, ["-2", "out of range"], {}),
    "layer_name": ({"layers": ["final-norm"]}, ["final-norm", "final_norm"], {}),
    "layers_not_list": ({"layers": "x"}, ["layers", "list"], {}),
    # A bool is no layer id (the engine's own check says so); not "layer 1".
    "layer_bool": ({"layers": [True]}, ["true"], {}),
    "layers_empty": ({"layers": []}, ["layers", "empty"], {}),
    "layers_duplicate": ({"layers": [2, 2]}, ["duplicate"], {}),
    "prompt_not_bool": ({"prompt": "yes"}, ["prompt"], {}),
    "output_not_bool": ({"output": "no"}, ["output"], {}),
    "neither": ({"prompt": False, "output": False}, ["neither"], {}),
    "unknown_field": ({"layer": [0]}, ["layer", "extra"], {}),
    "encoding_hex": ({"encoding": "hex"}, ["encoding", "base64", "float"], {}),
    "not_an_object": (True, ["hidden_states"], {}),
    "over_cap": ({}, ["max_bytes_per_request", str(CAP_BYTES)], {"max_tokens": 100}),
}

ENDPOINTS = ("completions", "chat")


def request_body(
    model: str, endpoint: str, hs: Any, stream: bool, long: bool, **overrides: Any
) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        content = LONG_MESSAGE if long else "Hello there, small model."
        path, body = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": content}]},
        )
    else:
        path, body = (
            "/v1/completions",
            {"prompt": LONG_PROMPT if long else [10, 20, 30]},
        )
    body.update(model=model, max_tokens=4, temperature=0.0, stream=stream)
    body["hidden_states"] = hs
    body.update(overrides)
    return path, body


def assert_400(response: httpx.Response, words: list[str], what: str) -> str:
    text = response.text
    assert response.status_code == 400, (
        f"{what}: HTTP {response.status_code}: {text[:500]}"
    )
    assert response.headers["content-type"].startswith("application/json"), (
        f"{what}: {response.headers['content-type']}: {text[:300]}"
    )
    assert not text.startswith("data:"), f"{what}: an SSE body with a 400"
    error = response.json()["error"]
    message = str(error["message"])
    assert error.get("code") == 400, error
    for word in words:
        assert word.lower() in message.lower(), f"{what}: {word!r} not in {message!r}"
    return message


def good_request(http: httpx.Client, model: str, model_dir: str, endpoint: str) -> None:
    path, body = request_body(model, endpoint, {"layers": [2, -1]}, False, False)
    body.update(return_token_ids=True, ignore_eos=True, max_tokens=3)
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text[:1000]
    got = collect_response(response.json(), chat=endpoint == "chat")
    check(model_dir, got, Want([2, -1]), f"good {endpoint} after bad requests")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_400(http, served_model, model_dir, case, endpoint, stream):
    hs, words, overrides = BAD[case]
    path, body = request_body(
        served_model, endpoint, hs, stream, long=case == "over_cap", **overrides
    )
    response = http.post(path, json=body)
    assert_400(response, words, f"{case} {endpoint} {'stream' if stream else ''}")
    good_request(http, served_model, model_dir, endpoint)


def test_under_cap_with_fewer_layers(http, served_model, model_dir):
    """The cap counts the layers and positions asked for: the over-cap request
    fits with one layer, or without prompt rows."""
    for hs in ({"layers": [0]}, {"prompt": False}):
        path, body = request_body(served_model, "completions", hs, False, True)
        body.update(max_tokens=100, return_token_ids=True, ignore_eos=True)
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text[:1000]
        got = collect_response(response.json(), chat=False)
        want = Want([0]) if "layers" in hs else Want(prompt=False)
        check(model_dir, got, want, f"under cap {hs}")


def test_beam_search_is_400(http, served_model, model_dir):
    path, body = request_body(served_model, "completions", {}, False, False)
    body.update(use_beam_search=True, n=2)
    assert_400(http.post(path, json=body), ["beam search"], "beam search")
    good_request(http, served_model, model_dir, "completions")


def test_batch_chat_endpoint_refuses_hidden_states(http, served_model, model_dir):
    """/v1/chat/completions/batch cannot return states: a 400, never ignored."""
    body = {
        "model": served_model,
        "messages": [
            [{"role": "user", "content": "Hello there."}],
            [{"role": "user", "content": "And again."}],
        ],
        "max_tokens": 3,
        "hidden_states": {"layers": [2]},
    }
    response = http.post("/v1/chat/completions/batch", json=body)
    assert_400(response, ["hidden states", "/v1/chat/completions"], "batch chat")
    del body["hidden_states"]
    response = http.post("/v1/chat/completions/batch", json=body)
    assert response.status_code == 200, response.text[:500]
    assert len(response.json()["choices"]) == 2
    good_request(http, served_model, model_dir, "chat")


def test_openai_client_raises_bad_request(oai, served_model):
    import openai

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as excinfo:
            oai.completions.create(
                model=served_model,
                prompt="Hello",
                max_tokens=3,
                stream=stream,
                extra_body={"hidden_states": {"layers": [3]}},
            )
        assert excinfo.value.status_code == 400
        assert "not captured" in str(excinfo.value)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_server_without_config(plain_server, endpoint, stream):
    with httpx.Client(base_url=plain_server.url, timeout=60) as client:
        path, body = request_body(plain_server.model_dir, endpoint, {}, stream, False)
        assert_400(
            client.post(path, json=body),
            ["without hidden_states_config", "--hidden-states-config"],
            f"no config {endpoint}",
        )
        # ... and it still serves requests without hidden states.
        path, body = request_body(plain_server.model_dir, endpoint, None, stream, False)
        del body["hidden_states"]
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text[:500]
