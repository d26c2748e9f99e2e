"""The OpenAI-compatible server on the tiny Qwen2.5-VL: chat requests with
`image_url` parts (data URLs, and local files under
`--allowed-local-media-path`) return hidden states, inline and by reference,
equal to HF's forward with the same pixels; bad image input gets a clear 400
and the server keeps serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hs.client import from_response
from vllm_hs.hf_reference import assert_states_close, hf_sequence_states
from vllm_hs.models.tiny_vl import seeded_image
from vllm_hs_testing.server import ServerProcess
from vllm_hs_testing.vision import VL_BLOCK, VL_LAYERS


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's --allowed-local-media-path, holding one PNG."""
    folder = tmp_path_factory.mktemp("media")
    seeded_image(32, 84, 56).save(folder / "picture.png")
    return folder


@pytest.fixture(scope="module")
def vl_server(
    vl_fp32: str, media_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = ServerProcess(
        vl_fp32,
        tmp_path_factory.mktemp("vl-server") / "server.log",
        {"layers": VL_LAYERS},
        extra_args=[
            "--limit-mm-per-prompt",
            '{"image": 2, "video": 0}',
            "--block-size",
            str(VL_BLOCK),
            "--allowed-local-media-path",
            str(media_dir),
        ],
    ).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _data_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server sees these pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(server: ServerProcess, content: list[dict[str, Any]], **extra: Any) -> Any:
    import httpx

    body = {
        "model": server.model_dir,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)


def _image_part(image: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _data_url(image)}}


@pytest.mark.parametrize("encoding", ["base64", "ref"])
def test_chat_with_image_url_parts(vl_server, vl_fp32, encoding):
    images = [seeded_image(30, 56, 56), seeded_image(31, 112, 112)]
    content = [*map(_image_part, images), {"type": "text", "text": "Compare them."}]
    response = _chat(vl_server, content, hidden_states={"encoding": encoding})
    assert response.status_code == 200, response.text
    body = response.json()
    states = from_response(body, server=vl_server.url)
    prompt_ids = body["prompt_token_ids"]
    tokens = body["choices"][0]["token_ids"]
    want_prompt, want_output = hf_sequence_states(
        vl_fp32, prompt_ids, tokens, VL_LAYERS, dtype=torch.float32, images=images
    )
    for got, want, what in (
        (states.prompt(), want_prompt, "prompt"),
        (states.output(), want_output, "output"),
    ):
        assert got is not None, what
        assert_states_close(got, want, dtype=torch.float32, what=f"{encoding} {what}")


def test_an_unreadable_image_is_refused_and_the_server_serves_on(vl_server):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    response = _chat(
        vl_server, [part, {"type": "text", "text": "What?"}], hidden_states={}
    )
    assert response.status_code == 400, response.text
    assert "image" in response.text.lower(), response.text
    after = _chat(vl_server, [{"type": "text", "text": "Hi."}], hidden_states={})
    assert after.status_code == 200, after.text


def _file_part(path: Path) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"file://{path}"}}


def test_chat_with_a_local_file_image(vl_server, vl_fp32, media_dir):
    from PIL import Image

    path = media_dir / "picture.png"
    content = [_file_part(path), {"type": "text", "text": "What is it?"}]
    response = _chat(vl_server, content, hidden_states={})
    assert response.status_code == 200, response.text
    body = response.json()
    states = from_response(body)
    with Image.open(path) as image:
        pixels = image.convert("RGB")
    want_prompt, want_output = hf_sequence_states(
        vl_fp32,
        body["prompt_token_ids"],
        body["choices"][0]["token_ids"],
        VL_LAYERS,
        dtype=torch.float32,
        images=[pixels],
    )
    for got, want, what in (
        (states.prompt(), want_prompt, "file prompt"),
        (states.output(), want_output, "file output"),
    ):
        assert got is not None, what
        assert_states_close(got, want, dtype=torch.float32, what=what)


@pytest.mark.parametrize(
    "name, message",
    [
        # 400 with the series' fix (was 500, the OSError of reading it).
        ("missing.png", "Cannot read the local media file"),
        ("../outside.png", "must be a subpath"),
    ],
)
def test_a_local_file_the_server_may_not_read_is_refused(
    vl_server, media_dir, name, message
):
    content = [_file_part(media_dir / name), {"type": "text", "text": "What?"}]
    response = _chat(vl_server, content, hidden_states={})
    assert response.status_code == 400, response.text
    assert message in response.text, response.text
    after = _chat(vl_server, [{"type": "text", "text": "Hi."}], hidden_states={})
    assert after.status_code == 200, after.text


def test_more_images_than_the_limit_are_refused(vl_server):
    parts = [_image_part(seeded_image(40 + i)) for i in range(3)]
    response = _chat(
        vl_server, [*parts, {"type": "text", "text": "Three?"}], hidden_states={}
    )
    assert response.status_code == 400, response.text
    assert "at most 2" in response.text.lower(), response.text
    assert (
        _chat(
            vl_server, [{"type": "text", "text": "Hi."}], hidden_states={}
        ).status_code
        == 200
    )


def test_log_has_no_traceback(vl_server):
    # Refused requests are the client's errors: no engine traceback.
    log = Path(vl_server.log_path).read_text(errors="replace")
    assert "EngineCore encountered a fatal error" not in log
