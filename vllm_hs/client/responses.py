"""Turn hidden states in OpenAI-compatible responses back into tensors.

Works on what the `openai` client returns (`Completion`, `ChatCompletion` and
their stream chunks: the extra fields stay reachable as attributes) and on raw
HTTP JSON (`dict`). The wire format (docs/server.md):

    {"layers": [...], "shape": [rows, layers, hidden], "dtype": "bfloat16",
     "encoding": "base64" | "float", "data": ...,
     "positions": [...]}  # only when the request set "positions"

`base64` data is the raw little-endian bytes of the tensor in its dtype.
`"encoding": "ref"` payloads carry `"url"` (and `"path"` of the file on the
server's host with its shm store, `"manifest"` of the object with its Mooncake
store) instead of `"data"`: pass `server` (the base URL, the `openai` client,
or a `RefFetcher`) and they are fetched: mapped from the file when this host
sees it, read from the Mooncake store when the fetcher is given its config,
else over HTTP.

    resp = client.completions.create(..., extra_body={"hidden_states": {}})
    states = from_response(resp)
    states.prompt(0), states.output(0)   # tensors [P, K, H], [G-1, K, H]

    resp = client.completions.create(
        ..., extra_body={"hidden_states": {"encoding": "ref"}}
    )
    states = from_response(resp, server=client)
"""

from __future__ import annotations

import base64
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin

import torch

from vllm_hs.extract.safetensors_file import map_safetensors

__all__ = [
    "RefFetcher",
    "ResponseHiddenStates",
    "decode",
    "from_response",
    "from_stream",
    "map_safetensors",
    "sse_events",
]


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(name)
    return value


@dataclass(frozen=True)
class RefFetcher:
    """Fetches `"encoding": "ref"` payloads: the safetensors file at the
    payload's `path` when this host sees it (the server's shm store), mapped
    without a copy; the Mooncake object its `manifest` names, when `mooncake`
    configures a client of that store (any node); else `GET <server><url>`."""

    server: str
    """The server's base URL (`http://host:8000` or `.../v1`)."""
    api_key: str | None = None
    local: bool = True
    """Read `path` when it exists here."""
    timeout_s: float = 600.0
    mooncake: Mapping[str, Any] | None = None
    """hs-connectors' `MooncakeStoreConfig` keys (`master_server_address`,
    `metadata_server`, ...) of the server's Mooncake store, to read its
    references from the store rather than over HTTP."""
    _mooncake_store: list[Any] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    @classmethod
    def of(cls, server: Any, api_key: str | None = None) -> RefFetcher:
        """From a base URL or an `openai` client (its base URL and key)."""
        if isinstance(server, RefFetcher):
            return server
        if hasattr(server, "base_url"):
            api_key = api_key or getattr(server, "api_key", None)
            server = str(server.base_url)
        return cls(str(server), api_key)

    def __call__(self, payload: Any) -> torch.Tensor:
        from safetensors.torch import load

        path = _get(payload, "path")
        size = _get(payload, "bytes")
        manifest = _get(payload, "manifest")
        if (
            self.local
            and path
            and os.path.isfile(path)
            and os.path.getsize(path) == size
        ):
            tensors = map_safetensors(path)
        elif manifest is not None and self.mooncake is not None:
            tensors = self._mooncake().get_sample(dict(manifest))
        else:
            url = str(_get(payload, "url"))
            with self._open(url) as reply:
                body = reply.read()
            if size is not None and len(body) != int(size):
                raise ValueError(
                    f"hidden states at {url}: {len(body)} bytes, expected {size}"
                )
            tensors = load(body)
        return tensors["hidden_states"]

    def delete(self, url: str) -> None:
        """Drop the server's reference at `url` (references also expire)."""
        self._open(url, "DELETE").close()

    def _mooncake(self) -> Any:
        """hs-connectors' reader of the server's Mooncake store (made once)."""
        if not self._mooncake_store:
            from hs_connectors.mooncake_store import (
                MooncakeHiddenStatesStore,
                MooncakeStoreConfig,
            )

            config = MooncakeStoreConfig.from_dict(dict(self.mooncake or {}))
            self._mooncake_store.append(MooncakeHiddenStatesStore(config).setup())
        return self._mooncake_store[0]

    def _open(self, url: str, method: str = "GET") -> Any:
        """The server's reply to `method` on `url` (relative to `server`),
        with the API key; an HTTP error raises ValueError with its body."""
        full = urljoin(self.server, url)
        request = urllib.request.Request(full, method=method)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:
            raise ValueError(
                f"hidden states at {full}: HTTP {error.code}: "
                f"{error.read().decode(errors='replace')}"
            ) from error


def decode(payload: Any, fetch: RefFetcher | None = None) -> torch.Tensor:
    """One payload (dict or object with the wire fields) -> tensor; `fetch`
    reads `"ref"` payloads."""
    if not isinstance(payload, Mapping) and callable(
        getattr(payload, "model_dump", None)
    ):
        # A pydantic object (vLLM's own payload renders its data only then).
        payload = payload.model_dump()
    shape = [int(n) for n in _get(payload, "shape")]
    dtype_name = str(_get(payload, "dtype"))
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown hidden-state dtype {dtype_name!r}")
    encoding = _get(payload, "encoding")
    data = _get(payload, "data")
    if encoding == "ref":
        if fetch is None:
            raise ValueError(
                'an "encoding": "ref" payload needs the server to fetch it from '
                "(from_response(..., server=...))"
            )
        rows = fetch(payload)
        if list(rows.shape) != shape or rows.dtype != dtype:
            raise ValueError(
                f"fetched hidden states are {rows.dtype} {list(rows.shape)}, the "
                f"payload says {dtype_name} {shape}"
            )
        return rows
    if encoding == "float":
        return torch.tensor(data, dtype=torch.float32).reshape(shape).to(dtype)
    if encoding != "base64":
        raise ValueError(f"unknown hidden-state encoding {encoding!r}")
    raw = bytearray(base64.b64decode(data))
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = itemsize * int(torch.Size(shape).numel())
    if len(raw) != expected:
        raise ValueError(
            f"hidden-state payload has {len(raw)} bytes, shape {shape} of "
            f"{dtype_name} needs {expected}"
        )
    if not raw:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.frombuffer(raw, dtype=torch.uint8)
    if sys.byteorder != "little" and itemsize > 1:
        tensor = tensor.reshape(-1, itemsize).flip(1).reshape(-1)
    return tensor.view(dtype).reshape(shape)


@dataclass
class ResponseHiddenStates:
    """Decoded states of one response (or a whole stream), by choice index."""

    prompts: dict[int, torch.Tensor] = field(default_factory=dict)
    """Prompt states: for chat under index 0; for completions under the index
    of the first choice of each prompt."""
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    layers: list[int | str] | None = None
    prompt_positions: dict[int, list[int]] = field(default_factory=dict)
    """Position of each prompt row, when the request set "positions"."""
    output_positions: dict[int, list[int]] = field(default_factory=dict)
    """Position of each output row, when the request set "positions"."""
    fetch: RefFetcher | None = None
    """Reads `"ref"` payloads."""

    def prompt(self, index: int = 0) -> torch.Tensor | None:
        return self.prompts.get(index)

    def output(self, index: int = 0) -> torch.Tensor | None:
        return self.outputs.get(index)

    def _add(self, target: dict[int, torch.Tensor], index: int, payload: Any) -> None:
        if payload is None:
            return
        rows = decode(payload, self.fetch)
        self.layers = list(_get(payload, "layers"))
        previous = target.get(index)
        target[index] = rows if previous is None else torch.cat([previous, rows])
        positions = _get(payload, "positions")
        if positions is not None:
            self.output_positions.setdefault(index, []).extend(
                int(p) for p in positions
            )

    def _add_prompt(self, index: int, payload: Any) -> None:
        if payload is None:
            return
        if index in self.prompts:
            # Prompt rows are sent once per prompt; a second payload would
            # silently double the rows.
            raise ValueError(f"prompt hidden states of choice {index} sent twice")
        self.prompts[index] = decode(payload, self.fetch)
        self.layers = list(_get(payload, "layers"))
        positions = _get(payload, "positions")
        if positions is not None:
            self.prompt_positions[index] = [int(p) for p in positions]

    def add(self, response_or_chunk: Any) -> None:
        """Fold in one response, or one stream chunk (output rows are
        appended; prompt rows may come only once per prompt)."""
        self._add_prompt(0, _get(response_or_chunk, "prompt_hidden_states"))
        for choice in _get(response_or_chunk, "choices") or ():
            index = int(_get(choice, "index"))
            self._add_prompt(index, _get(choice, "prompt_hidden_states"))
            self._add(self.outputs, index, _get(choice, "hidden_states"))


def from_response(
    response: Any, server: Any = None, api_key: str | None = None
) -> ResponseHiddenStates:
    """States of a non-streamed completion or chat completion. `server` (a
    base URL or the `openai` client) is where `"ref"` payloads are fetched."""
    states = ResponseHiddenStates(fetch=_fetcher(server, api_key))
    states.add(response)
    return states


def from_stream(
    chunks: Iterable[Any], server: Any = None, api_key: str | None = None
) -> ResponseHiddenStates:
    """States of a stream: the deltas of every chunk, concatenated in order."""
    states = ResponseHiddenStates(fetch=_fetcher(server, api_key))
    for chunk in chunks:
        if isinstance(chunk, (str, bytes)):
            continue  # raw SSE keep-alives or [DONE]
        states.add(chunk)
    return states


def _fetcher(server: Any, api_key: str | None) -> RefFetcher | None:
    return None if server is None else RefFetcher.of(server, api_key)


def sse_events(lines: Iterable[str | bytes]) -> Iterator[dict[str, Any]]:
    """Parse a raw HTTP server-sent-event stream (`data: {...}` lines) into
    chunk dicts, stopping at `data: [DONE]`; feed them to `from_stream`."""
    for line in lines:
        text = line.decode() if isinstance(line, bytes) else line
        text = text.strip()
        if not text.startswith("data:"):
            continue
        body = text[len("data:") :].strip()
        if body == "[DONE]":
            return
        event = json.loads(body)
        if "error" in event:
            raise RuntimeError(f"server error in stream: {event['error']}")
        yield event
