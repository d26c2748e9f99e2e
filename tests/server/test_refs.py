"""Hidden states by reference (`"encoding": "ref"`) against the real server.

Both servers keep references in the default shm store; the refs server runs
two API server processes over it (`--api-server-count 2`), with a short ttl, a
small byte bound and an API key (tests/server/conftest.py). Rows fetched by
reference are checked against HF like every other encoding."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from vllm_hs.client import RefFetcher
from vllm_hs.hf_reference import assert_states_close, hf_hidden_states
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.main_engine import HIDDEN, MAIN_LAYERS
from vllm_hs_testing.server import (
    REFS_API_KEY,
    REFS_MAX_BYTES,
    REFS_TTL_S,
    Want,
    check,
    collect_response,
    collect_stream,
    get,
    resolve,
)

ROUTE = "/v1/hidden_states/"


def _complete(oai: Any, model: str, stream: bool, hs: dict[str, Any], **kwargs: Any):
    response = oai.completions.create(
        model=model,
        prompt=kwargs.pop("prompt", "The small cat sat by the river and looked at"),
        max_tokens=kwargs.pop("max_tokens", 6),
        stream=stream,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "hidden_states": hs},
        **kwargs,
    )
    fetch = RefFetcher.of(oai)
    if stream:
        return collect_stream(response, chat=False, fetch=fetch)
    return collect_response(response, chat=False, fetch=fetch)


def _raw(http: httpx.Client, body: dict[str, Any], key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = http.post("/v1/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _body(model: str, prompt_len: int, seed: int, **hs: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": seeded_prompt(seed, prompt_len),
        "max_tokens": 2,
        "temperature": 0.0,
        "hidden_states": {"encoding": "ref", **hs},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_rows_by_ref_equal_hf(oai, served_model, model_dir, stream):
    got = _complete(oai, served_model, stream, {"encoding": "ref"})
    check(model_dir, got, Want(), "ref", stream=stream)
    assert got.payloads
    for _kind, _index, payload in got.payloads:
        assert get(payload, "encoding") == "ref", payload
        assert get(payload, "data") is None, payload
        assert get(payload, "url").startswith(ROUTE) and get(payload, "bytes") > 0
        assert os.path.isfile(get(payload, "path"))  # the default shm store
        assert get(payload, "manifest") is None


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_rows_by_ref_equal_hf(oai, served_model, model_dir, stream):
    messages = [{"role": "user", "content": "Tell me a small story about a red cat."}]
    response = oai.chat.completions.create(
        model=served_model,
        messages=messages,
        max_tokens=5,
        stream=stream,
        temperature=0.0,
        extra_body={
            "return_token_ids": True,
            "ignore_eos": True,
            "hidden_states": {"encoding": "ref", "layers": [2, "final_norm"]},
        },
    )
    collect = collect_stream if stream else collect_response
    got = collect(response, chat=True, fetch=RefFetcher.of(oai))
    check(model_dir, got, Want([2, "final_norm"]), "chat ref", stream=stream)


def test_fetch_again_then_delete(http, served_model):
    reply = _raw(http, _body(served_model, 20, 1, positions="last"))
    payload = reply["choices"][0]["prompt_hidden_states"]
    assert payload["positions"] == [19]
    first = http.get(payload["url"])
    assert first.status_code == 200, first.text
    assert first.headers["content-type"] == "application/octet-stream"
    assert len(first.content) == payload["bytes"]
    assert http.get(payload["url"]).content == first.content  # again, the same
    tensors = load(first.content)
    assert tensors["hidden_states"].shape == (1, len(MAIN_LAYERS), HIDDEN)
    assert tensors["positions"].tolist() == [19]
    # The layers travel in the file's metadata.
    header_len = int.from_bytes(first.content[:8], "little")
    header = json.loads(first.content[8 : 8 + header_len])
    assert json.loads(header["__metadata__"]["layers"]) == resolve(None)
    assert http.delete(payload["url"]).status_code == 204
    gone = http.get(payload["url"])
    assert gone.status_code == 404 and "not held" in gone.json()["error"]["message"]
    assert http.delete(payload["url"]).status_code == 404


@pytest.mark.parametrize("ref_id", ["unknown", "x" * 32, "..%2F..%2Fetc%2Fpasswd"])
def test_unknown_or_foreign_ids_are_404(http, hs_server, ref_id):
    reply = http.get(ROUTE + ref_id)
    assert reply.status_code == 404, reply.text
    if "%2F" not in ref_id:  # a path that leaves the route: the router's 404
        assert "not held" in reply.json()["error"]["message"]


def test_every_process_answers_for_every_reference(refs_server, model_dir):
    """12 completions, each reference then fetched on a new connection (the
    kernel spreads connections over both API server processes): every one is
    found, and its rows equal HF's."""
    fetch = RefFetcher(refs_server.url, REFS_API_KEY, local=False)
    paths = set()
    for seed in range(12):
        prompt = seeded_prompt(100 + seed, 6)
        with httpx.Client(base_url=refs_server.url, timeout=60) as http:
            body = _body(model_dir, 6, 0, output=False, layers=[2, "final_norm"])
            body["prompt"] = prompt
            payload = _raw(http, body, REFS_API_KEY)["choices"][0][
                "prompt_hidden_states"
            ]
        rows = fetch(payload)  # urllib: a new connection per request
        expected = hf_hidden_states(model_dir, prompt, [2, "final_norm"])
        assert_states_close(rows, expected, dtype=torch.float32, what=f"ref {seed}")
        paths.add(os.path.dirname(payload["path"]))
    assert len(paths) == 1  # one store for both processes


def test_refs_need_the_api_key(refs_server, served_model):
    with httpx.Client(base_url=refs_server.url, timeout=60) as http:
        body = _body(served_model, 12, 2, output=False)
        assert http.post("/v1/completions", json=body).status_code == 401
        payload = _raw(http, body, REFS_API_KEY)["choices"][0]["prompt_hidden_states"]
        assert http.get(payload["url"]).status_code == 401
        assert http.delete(payload["url"]).status_code == 401
        authorized = {"Authorization": f"Bearer {REFS_API_KEY}"}
        assert http.get(payload["url"], headers=authorized).status_code == 200


def test_co_located_path_equals_http(refs_server, served_model):
    with httpx.Client(base_url=refs_server.url, timeout=60) as http:
        body = _body(served_model, 16, 3, output=False)
        payload = _raw(http, body, REFS_API_KEY)["choices"][0]["prompt_hidden_states"]
    assert payload["path"].endswith(".safetensors")
    local = RefFetcher(refs_server.url, REFS_API_KEY)(payload)
    remote = RefFetcher(refs_server.url, REFS_API_KEY, local=False)(payload)
    assert local.shape == (16, len(MAIN_LAYERS), HIDDEN)
    assert torch.equal(local, remote)


def test_refs_expire(refs_server, served_model):
    authorized = {"Authorization": f"Bearer {REFS_API_KEY}"}
    with httpx.Client(base_url=refs_server.url, timeout=60) as http:
        body = _body(served_model, 8, 4, output=False)
        payload = _raw(http, body, REFS_API_KEY)["choices"][0]["prompt_hidden_states"]
        assert http.get(payload["url"], headers=authorized).status_code == 200
        time.sleep(REFS_TTL_S + 1)
        gone = http.get(payload["url"], headers=authorized)
    assert gone.status_code == 404 and "expired" in gone.json()["error"]["message"]
    assert not os.path.exists(payload["path"])


def test_byte_bound_drops_the_oldest(refs_server, served_model):
    """The bound holds across the API server processes: each request on a
    new connection."""
    authorized = {"Authorization": f"Bearer {REFS_API_KEY}"}
    payloads = []
    while sum(p["bytes"] for p in payloads) <= REFS_MAX_BYTES:
        body = _body(served_model, 24, 10 + len(payloads), output=False)
        with httpx.Client(base_url=refs_server.url, timeout=60) as http:
            reply = _raw(http, body, REFS_API_KEY)
        payloads.append(reply["choices"][0]["prompt_hidden_states"])
    statuses = []
    for p in payloads:
        with httpx.Client(base_url=refs_server.url, timeout=60) as http:
            statuses.append(http.get(p["url"], headers=authorized).status_code)
    assert statuses[0] == 404 and statuses[-1] == 200, statuses
    pairs = zip(payloads, statuses, strict=True)
    held = [p["bytes"] for p, status in pairs if status == 200]
    assert sum(held) <= REFS_MAX_BYTES


def test_client_disconnecting_mid_download(refs_server, served_model):
    authorized = {"Authorization": f"Bearer {REFS_API_KEY}"}
    with httpx.Client(base_url=refs_server.url, timeout=60) as http:
        body = _body(served_model, 40, 5, output=False)
        payload = _raw(http, body, REFS_API_KEY)["choices"][0]["prompt_hidden_states"]
        with http.stream("GET", payload["url"], headers=authorized) as reply:
            assert reply.status_code == 200
            next(reply.iter_raw(1024))  # then drop the connection
        assert http.get("/health").status_code == 200
        again = http.get(payload["url"], headers=authorized)
    assert again.status_code == 200 and len(again.content) == payload["bytes"]


def test_a_reference_over_the_bound_is_a_clear_400(refs_server, served_model):
    """A response whose reference alone exceeds --hidden-states-ref-max-bytes
    fails with a message naming it; the server keeps serving."""
    headers = {"Authorization": f"Bearer {REFS_API_KEY}"}
    with httpx.Client(base_url=refs_server.url, timeout=60) as http:
        # 100 rows of 4 fp32 layers of 128: 200 KiB, over the 160 KiB bound.
        big = _body(served_model, 100, 6, output=False)
        reply = http.post("/v1/completions", json=big, headers=headers)
        assert reply.status_code == 400, reply.text
        assert "--hidden-states-ref-max-bytes" in reply.json()["error"]["message"]
        small = _body(served_model, 8, 7, output=False)
        assert _raw(http, small, REFS_API_KEY)["choices"][0]["prompt_hidden_states"]
