"""Start real `vllm serve` processes of the patched install and check the hidden
states of their responses against HF transformers.

Every check recomputes the expected rows with `vllm_hs.hf_reference` from the
token ids the server returned (`"return_token_ids": true`), so a row from the
wrong position, layer, choice or request fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_hs.client import RefFetcher, ResponseHiddenStates, sse_events
from vllm_hs.hf_reference import assert_states_close, hf_sequence_states
from vllm_hs.testing.harness import (
    CAP_BYTES,
    HIDDEN,
    MAIN_LAYERS,
    MAIN_RESOLVED,
    poll_until_empty,
)

HS_CONFIG: dict[str, Any] = {"layers": MAIN_LAYERS, "max_bytes_per_request": CAP_BYTES}
#: The refs test server (tests/server): references as files, a short ttl, a
#: small byte bound and an API key.
REFS_API_KEY = "refs-key"
REFS_TTL_S = 8
REFS_MAX_BYTES = 160 << 10

STARTUP_TIMEOUT_S = 180.0
DTYPE = torch.float32


def resolve(layers: list[int | str] | None) -> list[int | str]:
    """Layer ids as the server reports them (None = the whole server set)."""
    if layers is None:
        return list(MAIN_RESOLVED)
    return [4 if k == -1 else k for k in layers]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """`python -m vllm.entrypoints.cli.main serve` in its own process group,
    logging to a file; `start()` returns at once, `wait_ready()` polls /health."""

    def __init__(
        self,
        model_dir: str,
        log_path: Path,
        hidden_states_config: dict[str, Any] | None,
        extra_args: Iterable[str] = (),
    ) -> None:
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--enforce-eager",
            "--seed",
            "0",
            *extra_args,
        ]
        if hidden_states_config is not None:
            self.cmd += ["--hidden-states-config", json.dumps(hidden_states_config)]
        self.proc: subprocess.Popen[bytes] | None = None
        self._ready = False

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> ServerProcess:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        # Engine tests in the same session flip this; a server runs the default.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        # Dev-mode routes (/collective_rpc) let tests ask the worker what it holds.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, killed as one
            )
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        import httpx

        if self._ready:
            return self
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vllm serve exited with {code} during startup "
                    f"({' '.join(self.cmd)}); log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(f"{self.url}/health", timeout=5)
                if response.status_code == 200:
                    self._ready = True
                    return self
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"vllm serve not healthy after {timeout:.0f} s (last: {last}); "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # Workers that outlived the API server (same process group).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def processes(self, api_server: bool) -> list[Any]:
        """psutil processes: the API server itself (`api_server`) or all its
        descendants (engine core, workers)."""
        import psutil

        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        return [root] if api_server else root.children(recursive=True)

    def tree_rss(self) -> int:
        """Resident memory of the server and all its descendants, in bytes."""
        import psutil

        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        total = 0
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += process.memory_info().rss
        return total

    def collective_rpc(self, method: str) -> list[Any]:
        """The workers' answers to a `ChannelStateProbe` method (hs server),
        through the dev-mode /collective_rpc route."""
        import httpx

        response = httpx.post(
            f"{self.url}/collective_rpc", json={"method": method}, timeout=30
        )
        response.raise_for_status()
        return response.json()["results"]

    def worker_request_ids(self, timeout: float = 10.0) -> list[str]:
        """Requests the worker's hidden-state capturer still holds (the hs
        server's `ChannelStateProbe`), polled until empty or `timeout`: the
        engine core tells the worker of finished requests on its next step."""

        def fetch() -> list[str]:
            return [
                i for r in self.collective_rpc("hidden_states_request_ids") for i in r
            ]

        return poll_until_empty(fetch, timeout)

    def metric(self, name: str) -> float:
        """Sum of a Prometheus gauge/counter over its label sets."""
        import httpx

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        ]
        if not values:
            raise AssertionError(f"metric {name} not in /metrics")
        return sum(values)


# --- reading responses ------------------------------------------------------


def send_signal(processes: list[Any], sig: int) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)


def get(obj: Any, name: str) -> Any:
    """A field of a raw JSON dict or of an openai client object (extra fields
    live in `model_extra`)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


@dataclass
class Collected:
    """Tokens and decoded states of one response or stream, by choice index.

    `prompt_ids` holds the prompt token ids by choice index for completions
    and under 0 for chat. `states` comes from `vllm_hs.client`. For streams,
    `rows_vs_tokens` records after every chunk carrying token ids
    (index, output rows so far, tokens so far)."""

    chat: bool
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    states: ResponseHiddenStates = field(default_factory=ResponseHiddenStates)
    payloads: list[tuple[str, int, Any]] = field(default_factory=list)
    rows_vs_tokens: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_chunk: dict[int, int] = field(default_factory=dict)
    """stream: choice index (chat: 0) -> ordinal of the token-carrying chunk
    (of that choice; chat: of any choice) that brought the prompt states."""
    token_chunks: dict[int, int] = field(default_factory=dict)
    num_chunks: int = 0


def _record_payloads(out: Collected, obj: Any) -> None:
    top = get(obj, "prompt_hidden_states")
    if top is not None:
        out.payloads.append(("prompt", 0, top))
    for choice in get(obj, "choices") or ():
        index = int(get(choice, "index"))
        for kind, key in (
            ("prompt", "prompt_hidden_states"),
            ("output", "hidden_states"),
        ):
            payload = get(choice, key)
            if payload is not None:
                out.payloads.append((kind, index, payload))


def collect_response(
    response: Any, chat: bool, fetch: RefFetcher | None = None
) -> Collected:
    """A non-streamed completion / chat completion (dict or openai object);
    `fetch` reads `"encoding": "ref"` payloads."""
    out = Collected(chat=chat)
    out.states.fetch = fetch
    if chat:
        prompt = get(response, "prompt_token_ids")
        if prompt is not None:
            out.prompt_ids[0] = list(prompt)
    for choice in get(response, "choices") or ():
        index = int(get(choice, "index"))
        if not chat:
            prompt = get(choice, "prompt_token_ids")
            if prompt is not None:
                out.prompt_ids[index] = list(prompt)
        out.token_ids[index] = list(get(choice, "token_ids") or [])
        out.finish[index] = get(choice, "finish_reason")
    _record_payloads(out, response)
    out.states.add(response)
    return out


def collect_stream(
    chunks: Iterable[Any], chat: bool, fetch: RefFetcher | None = None
) -> Collected:
    """A stream of chunks (dicts from `sse_events`, or openai chunk objects)."""
    out = Collected(chat=chat)
    out.states.fetch = fetch
    for chunk in chunks:
        out.num_chunks += 1
        if chat:
            prompt = get(chunk, "prompt_token_ids")
            if prompt is not None:
                # Upstream vLLM repeats them on each choice's role chunk (n > 1).
                previous = out.prompt_ids.setdefault(0, list(prompt))
                assert previous == list(prompt), "prompt_token_ids differ"
        for choice in get(chunk, "choices") or ():
            index = int(get(choice, "index"))
            if not chat:
                prompt = get(choice, "prompt_token_ids")
                if prompt is not None:
                    assert index not in out.prompt_ids, f"prompt ids twice ({index})"
                    out.prompt_ids[index] = list(prompt)
            new_tokens = list(get(choice, "token_ids") or [])
            tokens = out.token_ids.setdefault(index, [])
            tokens.extend(new_tokens)
            if new_tokens:
                out.token_chunks[index] = out.token_chunks.get(index, 0) + 1
            if get(choice, "finish_reason") is not None:
                out.finish[index] = get(choice, "finish_reason")
            if not chat and get(choice, "prompt_hidden_states") is not None:
                out.prompt_chunk.setdefault(index, out.token_chunks.get(index, 0))
        if any(get(c, "token_ids") for c in get(chunk, "choices") or ()):
            out.token_chunks[-1] = out.token_chunks.get(-1, 0) + 1  # any choice
        if chat and get(chunk, "prompt_hidden_states") is not None:
            out.prompt_chunk.setdefault(0, out.token_chunks.get(-1, 0))
        _record_payloads(out, chunk)
        out.states.add(chunk)
        for choice in get(chunk, "choices") or ():
            index = int(get(choice, "index"))
            if get(choice, "token_ids"):
                rows = out.states.output(index)
                out.rows_vs_tokens.append(
                    (
                        index,
                        0 if rows is None else rows.shape[0],
                        len(out.token_ids[index]),
                    )
                )
    return out


@dataclass
class Want:
    """What a request asked for: `layers` as sent (None = server default)."""

    layers: list[int | str] | None = None
    prompt: bool = True
    output: bool = True


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """HF references on one thread: the server shares the (few) cores, and
    idle-spinning OpenMP threads here would slow every server step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def reference(
    model_dir: str, prompt_ids: list[int], tokens: list[int], layers: list[int | str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `(prompt rows, output rows)` of a sequence, in float32."""
    with one_torch_thread():
        return hf_sequence_states(model_dir, prompt_ids, tokens, layers, dtype=DTYPE)


def check(
    model_dir: str,
    got: Collected,
    want: Want | None,
    what: str,
    *,
    n: int = 1,
    stream: bool = False,
) -> None:
    """Check every hidden-state row of a collected response against HF.

    `want=None`: the request did not ask for states, so none may come."""
    assert len(got.token_ids) == n, f"{what}: choices {sorted(got.token_ids)}"
    if want is None:
        assert not got.payloads, f"{what}: unasked states {got.payloads[:1]}"
        return
    layers = resolve(want.layers)
    ref_layers = list(want.layers) if want.layers is not None else list(MAIN_LAYERS)
    for kind, index, payload in got.payloads:
        assert list(get(payload, "layers")) == layers, (what, kind, index)
        assert get(payload, "dtype") == "float32", (what, get(payload, "dtype"))
        shape = list(get(payload, "shape"))
        assert shape[1:] == [len(layers), HIDDEN], (what, kind, index, shape)
    prompt_key = 0  # chat: the response; completions: first choice of the prompt
    prompt_ids = got.prompt_ids.get(prompt_key)
    assert prompt_ids, f"{what}: no prompt_token_ids (return_token_ids)"
    if not got.chat:
        for index, ids in got.prompt_ids.items():
            assert ids == prompt_ids, f"{what}: choice {index} has other prompt ids"
    sent = [index for kind, index, _ in got.payloads if kind == "prompt"]
    if want.prompt:
        assert sent == [prompt_key], (
            f"{what}: prompt_hidden_states sent {len(sent)} times (choices {sent}), "
            f"want once (on {prompt_key})"
        )
        assert sorted(got.states.prompts) == [prompt_key], (
            f"{what}: prompt states on {sorted(got.states.prompts)}, want once on "
            f"{prompt_key}"
        )
    else:
        assert not got.states.prompts, f"{what}: prompt states despite prompt=false"
    if not want.output:
        assert not got.states.outputs, f"{what}: output states despite output=false"
    for index in range(n):
        tokens = got.token_ids[index]
        assert tokens, f"{what}: choice {index} has no token_ids"
        ref_prompt, ref_output = reference(model_dir, prompt_ids, tokens, ref_layers)
        if want.prompt and index == prompt_key:
            rows = got.states.prompt(prompt_key)
            assert rows.dtype == DTYPE, (what, rows.dtype)
            assert_states_close(
                rows, ref_prompt, dtype=DTYPE, what=f"{what} prompt", layers=layers
            )
        if want.output:
            rows = got.states.output(index)
            if rows is None:
                # Streams send no output payload while there are no rows.
                assert stream and len(tokens) == 1, f"{what}: no output states {index}"
                rows = torch.empty(0, len(layers), HIDDEN, dtype=DTYPE)
            assert rows.shape == (len(tokens) - 1, len(layers), HIDDEN), (
                f"{what} choice {index}: shape {tuple(rows.shape)} for "
                f"{len(tokens)} tokens"
            )
            assert_states_close(
                rows,
                ref_output,
                dtype=DTYPE,
                what=f"{what} choice {index} output",
                layers=layers,
                row_offset=len(prompt_ids),
            )
    if stream:
        check_stream_timing(got, want, what)


def check_stream_timing(got: Collected, want: Want, what: str) -> None:
    """Deltas arrive as they are made: after every chunk with tokens, a
    choice holds tokens - 1 output rows; prompt rows come with the first token."""
    if want.output:
        for index, rows, tokens in got.rows_vs_tokens:
            assert rows == tokens - 1, (
                f"{what}: choice {index} had {rows} output rows after {tokens} "
                "tokens in the stream (want tokens - 1)"
            )
    if want.prompt:
        assert got.prompt_chunk.get(0) == 1, (
            f"{what}: prompt states came in token chunk {got.prompt_chunk}, "
            "want with the first token"
        )


def sse_chunks(response: Any) -> Iterator[dict[str, Any]]:
    """Chunks of an httpx streaming response (`client.stream(...)`)."""
    return sse_events(response.iter_lines())
