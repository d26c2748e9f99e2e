"""A real Mooncake master on loopback for tests and benchmarks.

`mooncake_master` comes with the `mooncake-transfer-engine-non-cuda` package
(requirements/mooncake.txt); on Debian it needs `libibverbs1` and `librdmacm1`
even for TCP (`.ci/run` installs them). Every port the master and its clients
open is on 127.0.0.1: the master's RPC, HTTP metadata and metrics ports by its
flags, the clients' transfer engine by `MC_TCP_BIND_ADDRESS` and
`MOONCAKE_LOCAL_HOSTNAME`, which `start()` sets for this process and the
processes it starts.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_hs_testing.server.process import free_port

__all__ = ["MooncakeMaster", "master_binary", "unavailable_reason"]

#: Mooncake's store client per process: small, the tests move KiBs to MiBs.
SEGMENT_BYTES = 64 << 20
START_TIMEOUT_S = 30.0


def master_binary() -> str | None:
    """The `mooncake_master` of this interpreter's environment, or on PATH."""
    beside = Path(sys.executable).with_name("mooncake_master")
    if beside.exists():
        return str(beside)
    return shutil.which("mooncake_master")


def unavailable_reason() -> str | None:
    """Why no master can run here (one line), or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:
        return (
            f"Mooncake is not installed ({error}): "
            "pip install -r requirements/mooncake.txt"
        )
    if master_binary() is None:
        return "mooncake_master not found beside this Python or on PATH"
    return None


class MooncakeMaster:
    """`mooncake_master` with its HTTP metadata server, on free loopback ports,
    logging to a file; stopped with `stop()` (or as a context manager)."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def store_config(self, segment_bytes: int = SEGMENT_BYTES) -> dict[str, Any]:
        """`--hidden-states-ref-store-config` (hs-connectors'
        `MooncakeStoreConfig` keys) of a client of this master."""
        return {
            "local_hostname": "127.0.0.1",
            "metadata_server": f"http://127.0.0.1:{self.http_port}/metadata",
            "master_server_address": self.address,
            "global_segment_size": segment_bytes,
            "local_buffer_size": segment_bytes,
            "protocol": "tcp",
            "device_name": "",
        }

    def start(self) -> MooncakeMaster:
        binary = master_binary()
        if binary is None:
            raise RuntimeError(unavailable_reason())
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        os.environ["MOONCAKE_LOCAL_HOSTNAME"] = "127.0.0.1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--rpc_port={self.rpc_port}",
                    "--rpc_address=127.0.0.1",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={self.http_port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mooncake_master did not start:\n{tail}")
            time.sleep(0.1)
        return self

    def _listening(self) -> bool:
        for port in (self.rpc_port, self.http_port):
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
            except OSError:
                return False
        return True

    def kill(self) -> None:
        """Lose the master at once (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
