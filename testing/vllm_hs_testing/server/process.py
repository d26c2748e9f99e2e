"""Real `vllm serve` processes of the patched install, started and stopped
cleanly (own process group, log file, health wait), and their test settings."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_hs_testing.engines import poll_until_empty
from vllm_hs_testing.main_engine import CAP_BYTES, MAIN_LAYERS

HS_CONFIG: dict[str, Any] = {"layers": MAIN_LAYERS, "max_bytes_per_request": CAP_BYTES}
#: The refs test server (tests/server): two API server processes over the shm
#: reference store, a short ttl, a small byte bound and an API key.
REFS_API_KEY = "refs-key"
REFS_TTL_S = 8
REFS_MAX_BYTES = 160 << 10

STARTUP_TIMEOUT_S = 180.0


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


def send_signal(processes: list[Any], sig: int) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)
