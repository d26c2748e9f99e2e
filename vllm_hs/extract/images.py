"""Images in `vllm-hs extract`'s conversations: the image parts accepted in
content lists, reading and checking the image files, what the chat template
sees, what the engine gets, and how the engine's expanded prompt maps back to
the rendered one.

**Image parts.** A content list (`vllm_hs.extract.inputs`) may hold, besides
text parts:

* OpenAI: ``{"type": "image_url", "image_url": {"url": URL}}``;
* speculators' input form: ``{"type": "image", "path": PATH}`` or
  ``{"type": "image", "url": URL}``.

URL is a ``data:image/...;base64,...`` URL (kept as given), a ``file://`` URL
of an absolute path, or a plain path (absolute, or relative to the directory
holding --data). Every image part becomes the OpenAI part with its canonical
URL: the data URL as given, or ``file://`` + the absolute path. Other URLs
(http) are refused: extraction reads local data only.

**Rendering.** The chat template sees each image part as ``{"type":
"image"}``, the part every vision-language template knows; it emits the
model's placeholder once per image (Qwen:
``<|vision_start|><|image_pad|><|vision_end|>``). vLLM's processor expands the
placeholder to the image's token count: `expand_loss_mask` checks the engine's
expanded ids against the rendered ones and widens the loss mask.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = [
    "ImageError",
    "collapse_image_runs",
    "expand_loss_mask",
    "has_images",
    "image_part",
    "image_sha256",
    "image_urls",
    "load_image",
    "messages_json",
    "read_image",
    "template_messages",
]

_DATA_PREFIX = "data:image/"


class ImageError(ValueError):
    """An image part names no image vLLM-hs can read."""


def image_part(part: dict[str, Any], base_dir: Path) -> dict[str, Any] | None:
    """The canonical OpenAI image part of an image part of any accepted form,
    or None when ``part`` is not an image part; raises ImageError for an image
    part without a usable reference."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        reference = value.get("url") if isinstance(value, dict) else value
    elif kind == "image":
        reference = part.get("path") or part.get("url")
        if reference is None:
            keys = sorted(k for k in part if k != "type")
            raise ImageError(
                f"image part with keys {keys}: give 'path' or 'url' (inline "
                "images are not accepted)"
            )
    else:
        return None
    if not isinstance(reference, str) or not reference:
        raise ImageError(f"{kind} part without a URL or path: {part!r}")
    return {"type": "image_url", "image_url": {"url": _canonical(reference, base_dir)}}


def _canonical(reference: str, base_dir: Path) -> str:
    if reference.startswith(_DATA_PREFIX):
        return reference
    parsed = urlparse(reference)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
        if not path.is_absolute() or parsed.netloc not in ("", "localhost"):
            raise ImageError(f"{reference!r}: a file URL needs an absolute path")
    elif not parsed.scheme:
        path = Path(reference)
        if not path.is_absolute():
            path = base_dir / path
    else:
        raise ImageError(
            f"{_short(reference)}: only data:image/ URLs, file:// URLs and local "
            "paths are read (download the image first)"
        )
    return f"file://{path.resolve()}"


def _short(url: str) -> str:
    return url if len(url) <= 80 else url[:60] + "...(" + str(len(url)) + " chars)"


def read_image(url: str) -> bytes:
    """The encoded bytes of a canonical image URL, checked to decode as an
    image; raises ImageError naming the image."""
    if url.startswith(_DATA_PREFIX):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ImageError(f"{_short(url)}: only base64 data URLs are read")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ImageError(f"{_short(url)}: not base64 ({e})") from None
    else:
        path = Path(unquote(urlparse(url).path))
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ImageError(f"image {path}: {e.strerror or e}") from None
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except Exception as e:  # noqa: BLE001 - PIL raises many types
        raise ImageError(
            f"image {_short(url)}: not a readable image ({type(e).__name__}: {e})"
        ) from None
    return data


def image_sha256(url: str) -> str:
    """SHA-256 of the image's bytes (checked to decode)."""
    return hashlib.sha256(read_image(url)).hexdigest()


def load_image(url: str) -> Any:
    """The image of a canonical URL as an RGB PIL image (as vLLM loads an
    ``image_url``)."""
    from PIL import Image

    image = Image.open(io.BytesIO(read_image(url)))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a conversation holds an image (only image turns have lists)."""
    return any(not isinstance(m["content"], str) for m in messages)


def image_urls(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The canonical URLs of a conversation's images, in order."""
    return [
        part["image_url"]["url"]
        for message in messages
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == "image_url"
    ]


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the chat template gets it: image parts as
    ``{"type": "image"}`` (text conversations unchanged)."""
    if not has_images(messages):
        return list(messages)
    return [
        m
        if isinstance(m["content"], str)
        else {
            **m,
            "content": [
                {"type": "image"} if p["type"] == "image_url" else p
                for p in m["content"]
            ],
        }
        for m in messages
    ]


def messages_json(messages: Sequence[dict[str, Any]]) -> str:
    """The conversation in OpenAI content-list form (every content a list of
    parts), as JSON: speculators' ``messages`` column of a multimodal dataset."""
    return json.dumps(
        [
            {
                "role": m["role"],
                "content": (
                    [{"type": "text", "text": m["content"]}]
                    if isinstance(m["content"], str)
                    else list(m["content"])
                ),
            }
            for m in messages
        ],
        sort_keys=True,
    )


def collapse_image_runs(ids: Sequence[int], image_token: int) -> list[int]:
    """``ids`` with every run of ``image_token`` collapsed to one."""
    out: list[int] = []
    for token in ids:
        if token != image_token or not out or out[-1] != image_token:
            out.append(int(token))
    return out


def expand_loss_mask(
    ids: Sequence[int],
    mask: Sequence[int],
    expanded: Sequence[int],
    image_token: int,
) -> list[int] | None:
    """The loss mask of the engine's ``expanded`` prompt: 0 on every image
    position, the rendered mask elsewhere; None unless ``expanded`` collapses
    back to the rendered ``ids`` (each run of ``image_token`` to one)."""
    if collapse_image_runs(expanded, image_token) != collapse_image_runs(
        ids, image_token
    ):
        return None
    # Equal once collapsed: the non-image tokens correspond in order.
    text_mask = iter(m for t, m in zip(ids, mask, strict=True) if t != image_token)
    return [0 if t == image_token else next(text_mask) for t in expanded]
