"""`vllm_hs.client` without a server.

Payloads are made with the server's own encoder
(`vllm.entrypoints.openai.hidden_states.encode_hidden_states`) where vLLM is
installed (tests needing it skip only when vLLM is missing, and fail under
VLLM_HS_EXPECT_PATCHED=1), and by hand otherwise.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from vllm_hs.client import (
    RefFetcher,
    ResponseHiddenStates,
    decode,
    from_response,
    from_stream,
    sse_events,
)
from vllm_hs.patched_vllm import expect_patched

try:
    import vllm  # noqa: F401
except ImportError:
    if expect_patched():
        raise
    encode_hidden_states = None
else:
    # vLLM is here: the module must be (a patched install), else fail loudly.
    from vllm.entrypoints.openai.hidden_states import encode_hidden_states

needs_vllm = pytest.mark.skipif(
    encode_hidden_states is None, reason="vLLM is not installed"
)

LAYERS: list[int | str] = [0, 2, 4, "final_norm"]
DTYPES = [torch.float32, torch.bfloat16]


def states(rows: int, dtype: torch.dtype, seed: int = 0, k: int = 4, h: int = 8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, h, generator=g) * 10).to(dtype)


def hand_payload(t: torch.Tensor, layers: list[int | str] = LAYERS) -> dict[str, Any]:
    """The wire format written out by hand (little-endian raw bytes)."""
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return {
        "layers": layers,
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "encoding": "base64",
        "data": base64.b64encode(raw).decode(),
    }


def server_payload(t: torch.Tensor, encoding: str) -> dict[str, Any]:
    """What the server sends: its encoder, dumped to JSON and parsed back."""
    payload = encode_hidden_states(t, LAYERS, encoding)
    return json.loads(payload.model_dump_json())


# --- decode -----------------------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("encoding", ["base64", "float"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_round_trip(dtype, encoding, rows):
    t = states(rows, dtype)
    payload = server_payload(t, encoding)
    assert payload["dtype"] == str(dtype).removeprefix("torch.")
    assert payload["encoding"] == encoding
    assert payload["shape"] == [rows, 4, 8]
    assert payload["layers"] == LAYERS
    out = decode(payload)
    assert out.dtype == dtype
    assert out.shape == t.shape
    assert torch.equal(out, t)  # bf16 -> float -> bf16 is exact too
    # The pydantic object itself decodes the same (its data rendered on dump).
    assert torch.equal(decode(encode_hidden_states(t, LAYERS, encoding)), t)


@needs_vllm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_server_base64_is_raw_little_endian(dtype):
    t = states(3, dtype, seed=1)
    assert server_payload(t, "base64")["data"] == hand_payload(t)["data"]


@needs_vllm
def test_non_contiguous_rows():
    t = states(6, torch.float32).transpose(0, 1).contiguous().transpose(0, 1)
    assert not t.is_contiguous()
    assert torch.equal(decode(server_payload(t, "base64")), t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hand_made_payload(dtype):
    t = states(5, dtype, seed=2)
    out = decode(hand_payload(t))
    assert out.dtype == dtype and torch.equal(out, t)
    # Writable, independent of the payload string.
    out += 1


@pytest.mark.parametrize("delta", [-1, 1, -4])
def test_wrong_byte_count_raises(delta):
    t = states(2, torch.float32)
    raw = t.view(torch.uint8).numpy().tobytes()
    payload = hand_payload(t)
    payload["data"] = base64.b64encode(
        raw[:delta] if delta < 0 else raw + b"\0" * delta
    ).decode()
    with pytest.raises(ValueError, match="bytes"):
        decode(payload)


def test_shape_mismatch_raises():
    payload = hand_payload(states(2, torch.bfloat16))
    payload["shape"] = [3, 4, 8]
    with pytest.raises(ValueError, match="bytes"):
        decode(payload)


@pytest.mark.parametrize("name", ["float7", "Size", "fp32", ""])
def test_unknown_dtype_raises(name):
    payload = hand_payload(states(1, torch.float32))
    payload["dtype"] = name
    with pytest.raises(ValueError, match="dtype"):
        decode(payload)


@pytest.mark.parametrize("encoding", ["hex", "BASE64", None])
def test_unknown_encoding_raises(encoding):
    payload = hand_payload(states(1, torch.float32))
    payload["encoding"] = encoding
    with pytest.raises(ValueError, match="encoding"):
        decode(payload)


def test_float_payload_by_hand():
    t = states(2, torch.float32, k=2, h=3)
    payload = {**hand_payload(t, [4, 0]), "encoding": "float", "data": t.tolist()}
    assert torch.equal(decode(payload), t)


# --- responses and streams ---------------------------------------------------


def completion_response(
    prompt: torch.Tensor, outputs: list[torch.Tensor], make=hand_payload
) -> dict[str, Any]:
    choices = []
    for i, rows in enumerate(outputs):
        choice = {"index": i, "text": "x", "hidden_states": make(rows)}
        if i == 0:
            choice["prompt_hidden_states"] = make(prompt)
        choices.append(choice)
    return {"object": "text_completion", "choices": choices}


def chat_response(prompt: torch.Tensor, outputs: list[torch.Tensor]) -> dict[str, Any]:
    return {
        "object": "chat.completion",
        "prompt_hidden_states": hand_payload(prompt),
        "choices": [
            {"index": i, "message": {"content": "x"}, "hidden_states": hand_payload(o)}
            for i, o in enumerate(outputs)
        ],
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_from_response_completion_n2(dtype):
    prompt, outs = states(5, dtype, 1), [states(3, dtype, 2), states(2, dtype, 3)]
    got = from_response(completion_response(prompt, outs))
    assert sorted(got.prompts) == [0] and sorted(got.outputs) == [0, 1]
    assert torch.equal(got.prompt(0), prompt) and got.prompt(1) is None
    assert torch.equal(got.output(0), outs[0]) and torch.equal(got.output(1), outs[1])
    assert got.layers == LAYERS


def test_from_response_chat():
    prompt, outs = states(9, torch.float32, 1), [states(4, torch.float32, 2)]
    got = from_response(chat_response(prompt, outs))
    assert torch.equal(got.prompt(), prompt)
    assert torch.equal(got.output(), outs[0])


def test_from_response_without_states():
    got = from_response({"choices": [{"index": 0, "text": "x", "hidden_states": None}]})
    assert got.prompts == {} and got.outputs == {} and got.layers is None
    assert got.prompt() is None and got.output() is None


def split_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    assert sum(sizes) == t.shape[0]
    return list(torch.split(t, sizes))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stream_concatenation_completions(dtype):
    """Completion chunks: prompt once (first token), output deltas per choice,
    interleaved choices, chunks without rows, keep-alive strings."""
    prompt = states(6, dtype, 1)
    out0, out1 = states(4, dtype, 2), states(3, dtype, 3)
    chunks: list[Any] = [
        {
            "choices": [
                {"index": 0, "text": "a", "prompt_hidden_states": hand_payload(prompt)}
            ]
        },
        {"choices": [{"index": 1, "text": "b"}]},
        ": keep-alive",
    ]
    parts0, parts1 = split_rows(out0, [1, 2, 1]), split_rows(out1, [2, 1])
    for i in range(3):
        chunks.append(
            {"choices": [{"index": 0, "hidden_states": hand_payload(parts0[i])}]}
        )
        if i < 2:
            chunks.append(
                {"choices": [{"index": 1, "hidden_states": hand_payload(parts1[i])}]}
            )
    chunks.append(b"data: [DONE]")
    got = from_stream(chunks)
    assert sorted(got.prompts) == [0]
    assert torch.equal(got.prompt(0), prompt)
    assert torch.equal(got.output(0), out0) and torch.equal(got.output(1), out1)


def test_stream_concatenation_chat():
    prompt, out = states(7, torch.float32, 1), states(5, torch.float32, 2)
    parts = split_rows(out, [1, 1, 3])
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"prompt_hidden_states": hand_payload(prompt), "choices": [{"index": 0}]},
    ] + [{"choices": [{"index": 0, "hidden_states": hand_payload(p)}]} for p in parts]
    got = from_stream(chunks)
    assert torch.equal(got.prompt(), prompt) and torch.equal(got.output(), out)


def test_add_folds_chunks_incrementally():
    out = states(4, torch.bfloat16)
    acc = ResponseHiddenStates()
    for part in split_rows(out, [2, 2]):
        acc.add({"choices": [{"index": 0, "hidden_states": hand_payload(part)}]})
    assert torch.equal(acc.output(0), out)


def sse_text(chunks: list[dict[str, Any]]) -> list[str]:
    lines = [": ping", ""]
    for chunk in chunks:
        lines += [f"data: {json.dumps(chunk)}", ""]
    return lines + ["data: [DONE]", "", 'data: {"after": "done"}']


def test_sse_events_round_trip():
    prompt, out = states(3, torch.float32, 1), states(2, torch.float32, 2)
    chunks = [
        {"choices": [{"index": 0, "prompt_hidden_states": hand_payload(prompt)}]},
        {"choices": [{"index": 0, "hidden_states": hand_payload(out[:1])}]},
        {"choices": [{"index": 0, "hidden_states": hand_payload(out[1:])}]},
    ]
    for lines in (sse_text(chunks), [line.encode() for line in sse_text(chunks)]):
        events = list(sse_events(lines))
        assert events == chunks  # stops at [DONE]
        got = from_stream(events)
        assert torch.equal(got.prompt(0), prompt) and torch.equal(got.output(0), out)
    # "data:" without a space is valid SSE too.
    assert list(sse_events(['data:{"a": 1}'])) == [{"a": 1}]


def test_sse_error_event_raises():
    lines = [
        'data: {"choices": []}',
        'data: {"error": {"message": "boom", "code": 500}}',
    ]
    events = sse_events(lines)
    assert next(events) == {"choices": []}
    with pytest.raises(RuntimeError, match="boom"):
        next(events)


# --- openai-client-like objects ------------------------------------------------


class Extra(BaseModel):
    model_config = ConfigDict(extra="allow")


class Choice(Extra):
    index: int
    text: str = ""


class Completion(Extra):
    choices: list[Choice]


def test_pydantic_objects_with_extra_fields():
    """Like the openai client: declared fields are attributes, the hidden
    states are extra fields (model_extra) holding plain dicts."""
    prompt, out = states(4, torch.bfloat16, 1), states(2, torch.bfloat16, 2)
    response = Completion.model_validate(completion_response(prompt, [out]))
    assert "hidden_states" in response.choices[0].model_extra
    got = from_response(response)
    assert torch.equal(got.prompt(0), prompt) and torch.equal(got.output(0), out)
    chunks = [
        Completion.model_validate(
            {"choices": [{"index": 0, "hidden_states": hand_payload(p)}]}
        )
        for p in split_rows(out, [1, 1])
    ]
    assert torch.equal(from_stream(chunks).output(0), out)


def test_payload_objects_as_attributes():
    """A payload given as an object with attributes (not a dict)."""
    t = states(3, torch.float32)
    payload = Extra.model_validate(hand_payload(t))
    assert torch.equal(decode(payload), t)


@pytest.mark.parametrize("kind", ["completion", "chat", "chat_chunk"])
def test_real_openai_types(kind):
    openai_types = pytest.importorskip("openai.types")
    chat_types = pytest.importorskip("openai.types.chat")
    prompt, out = states(5, torch.float32, 1), states(3, torch.float32, 2)
    if kind == "completion":
        raw = completion_response(prompt, [out])
        for choice in raw["choices"]:
            choice.update(finish_reason="length", logprobs=None)
        raw.update(id="c", created=0, model="m")
        response = openai_types.Completion.model_validate(raw)
        got = from_response(response)
    elif kind == "chat":
        raw = chat_response(prompt, [out])
        raw.update(id="c", created=0, model="m")
        for choice in raw["choices"]:
            choice.update(
                finish_reason="length", message={"role": "assistant", "content": "x"}
            )
        got = from_response(chat_types.ChatCompletion.model_validate(raw))
    else:
        base = {
            "id": "c",
            "created": 0,
            "model": "m",
            "object": "chat.completion.chunk",
        }
        chunks = [
            {
                **base,
                "prompt_hidden_states": hand_payload(prompt),
                "choices": [{"index": 0, "delta": {"content": "a"}}],
            },
        ] + [
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "b"},
                        "hidden_states": hand_payload(p),
                    }
                ],
            }
            for p in split_rows(out, [2, 1])
        ]
        got = from_stream(
            chat_types.ChatCompletionChunk.model_validate(c) for c in chunks
        )
    assert torch.equal(got.prompt(0), prompt)
    assert torch.equal(got.output(0), out)


def _ref_payload(rows: torch.Tensor, path: str | None = None) -> dict[str, Any]:
    from safetensors.torch import save

    body = save({"hidden_states": rows})
    payload: dict[str, Any] = {
        "layers": [0],
        "shape": list(rows.shape),
        "dtype": str(rows.dtype).removeprefix("torch."),
        "encoding": "ref",
        "url": "/v1/hidden_states/abc",
        "bytes": len(body),
    }
    if path is not None:
        with open(path, "wb") as f:
            f.write(body)
        payload["path"] = path
    return payload


def test_ref_payloads_are_fetched_over_http_with_the_key() -> None:
    """`"encoding": "ref"`: GET <server><url> with the API key (a stand-in
    HTTP server; tests/server/test_refs.py runs the real one)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from safetensors.torch import save

    rows = torch.randn(3, 1, 4).to(torch.bfloat16)
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization")))
            body = save({"hidden_states": rows})
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/v1"
        response = {"choices": [{"index": 0, "hidden_states": _ref_payload(rows)}]}
        states = from_response(response, server=base, api_key="k")
    finally:
        server.shutdown()
    assert torch.equal(states.output(0), rows)
    assert seen == [("/v1/hidden_states/abc", "Bearer k")]


def test_ref_payloads_read_a_co_located_file(tmp_path) -> None:
    rows = torch.randn(2, 1, 4)
    payload = _ref_payload(rows, str(tmp_path / "r.safetensors"))
    # No server reachable: the file is read.
    assert torch.equal(decode(payload, RefFetcher("http://127.0.0.1:9")), rows)
    with pytest.raises(ValueError, match="needs the server"):
        decode(payload)
    payload["shape"] = [3, 1, 4]
    with pytest.raises(ValueError, match="payload says"):
        decode(payload, RefFetcher("http://127.0.0.1:9"))
