"""Streams whose consumer lags behind the engine.

When the server's stream loop falls behind (a busy event loop, many requests),
vLLM merges the pending deltas of a request into one `RequestOutput` (for
n > 1: the outputs of several choices, with the prompt states). Under load this
happens by chance; here it is forced: the engine processes are paused while the
request is added, then the API server is paused while the engine generates
everything, so the server finds all the outputs queued at once. The merged
chunks must still carry the prompt states once and every output row once.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import httpx
import pytest

from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.server import (
    Collected,
    Want,
    check,
    collect_stream,
    send_signal,
    sse_chunks,
)

ADD_S = 1.0  # API server adds the request while the engine is paused
GENERATE_S = 2.0  # engine generates while the API server is paused


def lagged_stream(
    server: Any, path: str, body: dict[str, Any], chat: bool
) -> Collected:
    result: dict[str, Any] = {}

    def client() -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=90) as http:
                with http.stream("POST", path, json=body) as response:
                    if response.status_code != 200:
                        response.read()
                        raise AssertionError(
                            f"HTTP {response.status_code}: {response.text[:1000]}"
                        )
                    result["chunks"] = list(sse_chunks(response))
        except BaseException as e:  # reported by the test thread
            result["error"] = e

    thread = threading.Thread(target=client, daemon=True)
    engine, api = server.processes(api_server=False), server.processes(api_server=True)
    try:
        send_signal(engine, signal.SIGSTOP)
        thread.start()
        time.sleep(ADD_S)
        send_signal(api, signal.SIGSTOP)
        send_signal(engine, signal.SIGCONT)
        time.sleep(GENERATE_S)
    finally:
        send_signal(engine, signal.SIGCONT)
        send_signal(api, signal.SIGCONT)
    thread.join(timeout=90)
    assert not thread.is_alive(), "stream did not finish"
    if "error" in result:
        raise result["error"]
    return collect_stream(result["chunks"], chat=chat)


def body_for(endpoint: str, model: str, n: int, hs: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 4,
        "n": n,
        "temperature": 1.0 if n > 1 else 0.0,
        "seed": 5,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
        "hidden_states": hs,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "A story about a green tree."}]
    else:
        body["prompt"] = seeded_prompt(300, 25)
    return body


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.mark.parametrize("endpoint", list(PATHS))
def test_lagging_stream_n1(hs_server, served_model, model_dir, endpoint):
    """Merged deltas of one choice: rows and tokens still line up."""
    hs = {"layers": [2, "final_norm"]}
    body = body_for(endpoint, served_model, 1, hs)
    got = lagged_stream(hs_server, PATHS[endpoint], body, chat=endpoint == "chat")
    check(model_dir, got, Want([2, "final_norm"]), f"lagged {endpoint}", stream=True)


@pytest.mark.parametrize("endpoint", list(PATHS))
def test_lagging_stream_n4_prompt_states_once(
    hs_server, served_model, model_dir, endpoint
):
    hs = {"layers": [-1]}
    body = body_for(endpoint, served_model, 4, hs)
    got = lagged_stream(hs_server, PATHS[endpoint], body, chat=endpoint == "chat")
    sent = [index for kind, index, _ in got.payloads if kind == "prompt"]
    assert sent == [0], (
        f"{endpoint}: prompt_hidden_states sent {len(sent)} times "
        f"(on choices {sent}) in one n=4 stream, want once"
    )
    check(model_dir, got, Want([-1]), f"lagged {endpoint} n=4", n=4, stream=True)
