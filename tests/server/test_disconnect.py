"""Clients that drop a stream mid-way: the server aborts the requests, frees
them (no running requests, nothing left in the worker, no memory growth) and
keeps answering correctly."""

from __future__ import annotations

import time
from typing import Any

import httpx

from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.server import (
    Want,
    check,
    collect_response,
    collect_stream,
    sse_chunks,
)

WARMUP = 5
DISCONNECTS = 20
MAX_RSS_GROWTH = 32 << 20  # observed: ~5 MiB; a leak of the rows is ~0.4 MiB each
RUNNING_TIMEOUT_S = 30.0


def drop_stream(server: Any, model: str, i: int) -> None:
    """Start a long streamed request with states, read 3 chunks, disconnect."""
    if i % 2:
        path = "/v1/chat/completions"
        request = {"messages": [{"role": "user", "content": f"Story {i} of a cat."}]}
    else:
        path = "/v1/completions"
        request = {"prompt": seeded_prompt(900 + i, 10 + i % 7)}
    body = {
        "model": model,
        **request,
        "max_tokens": 200,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "hidden_states": {"layers": None if i % 3 else ["final_norm"]},
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            chunks = []
            for chunk in sse_chunks(response):
                chunks.append(chunk)
                if len(chunks) == 3:
                    break
            assert len(chunks) == 3
            assert all(c["choices"][0].get("finish_reason") is None for c in chunks)
        # Leaving both blocks closes the connection with the stream half read.


def wait_idle(server: Any, timeout: float = RUNNING_TIMEOUT_S) -> float:
    """Seconds until vllm:num_requests_running (and waiting) are 0."""
    start = time.monotonic()
    running = waiting = -1.0
    while time.monotonic() - start < timeout:
        running = server.metric("vllm:num_requests_running")
        waiting = server.metric("vllm:num_requests_waiting")
        if running == 0 and waiting == 0:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(
        f"requests still running {running} / waiting {waiting} {timeout:.0f} s "
        "after the clients disconnected"
    )


def settled_rss(server: Any) -> int:
    """Median of a few RSS samples of the server process tree."""
    samples = []
    for _ in range(5):
        samples.append(server.tree_rss())
        time.sleep(0.2)
    return sorted(samples)[len(samples) // 2]


def good_request(server: Any, model: str, model_dir: str, stream: bool) -> None:
    body = {
        "model": model,
        "prompt": seeded_prompt(999, 17),
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
        "hidden_states": {},
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                got = collect_stream(list(sse_chunks(response)), chat=False)
        else:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            got = collect_response(response.json(), chat=False)
    check(model_dir, got, Want(), f"after disconnects ({stream=})", stream=stream)


def test_disconnects_free_requests(hs_server, served_model, model_dir):
    log_start = hs_server.log_path.stat().st_size
    for i in range(WARMUP):
        drop_stream(hs_server, served_model, i)
    wait_idle(hs_server)
    before = settled_rss(hs_server)
    for i in range(WARMUP, WARMUP + DISCONNECTS):
        drop_stream(hs_server, served_model, i)
    waited = wait_idle(hs_server)
    assert hs_server.worker_request_ids() == [], "the worker kept dropped requests"
    after = settled_rss(hs_server)
    growth = after - before
    assert growth < MAX_RSS_GROWTH, (
        f"server RSS grew {growth / 2**20:.1f} MiB over {DISCONNECTS} dropped "
        f"streams ({before / 2**20:.0f} -> {after / 2**20:.0f} MiB)"
    )
    good_request(hs_server, served_model, model_dir, stream=False)
    good_request(hs_server, served_model, model_dir, stream=True)
    with open(hs_server.log_path, "rb") as log:
        log.seek(log_start)
        new_log = log.read().decode(errors="replace")
    assert "Traceback" not in new_log, new_log[-4000:]
    print(
        f"idle {waited:.1f} s after the last disconnect; RSS {before / 2**20:.0f} -> "
        f"{after / 2**20:.0f} MiB"
    )
