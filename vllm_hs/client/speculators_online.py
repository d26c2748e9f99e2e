"""speculators' online training from a patched vLLM server, states by reference.

speculators (>= 0.9) trains a draft model online: for every sample without
cached states it sends the server a completion (``max_tokens=1``,
``return_token_ids=true``) and hands the response's ``kv_transfer_params`` to
its hidden-states backend (hs-connectors' ``HiddenStatesTransfer``). Upstream's
backends read a file (or a Mooncake store) that a KV connector wrote. This one,
``--hidden-states-backend vllm-hs``, takes the states from the server itself:
a server started with

    vllm serve MODEL --hidden-states-config \\
        '{"layers": [2, 16, 29, 32], "respond_in_kv_transfer_params": true}'

puts a reference to each request's prompt states into ``kv_transfer_params``
(``handle``, ``hidden_states`` payload with ``"encoding": "ref"``,
``token_ids``). The backend fetches the rows from the server
(``--vllm-endpoint``), maps the file when the server runs on this host (its
default shm store), or, with ``--vllm-hs-read-mooncake``, reads them from the
server's Mooncake store (``--hidden-states-ref-store mooncake``; the store is
set with speculators' ``--mooncake-*`` options) on any node; then it deletes
the reference once speculators has checked the sample: no shared file system
needed, nothing left behind. A server with the Mooncake store also answers in
hs-connectors' transfer manifest, so speculators' own ``--hidden-states-backend
mooncake`` reads its responses as they are. Columns are the server's layers
in order; speculators reads the last as the verifier's last hidden state and
the others as aux layers, as in `vllm-hs extract`'s output.
``--hidden-states-path DIR`` (optional) also reads already extracted
``hs_{i}.safetensors`` files there first, as the file backend does.

The backend registers itself when this module is imported, which has to
happen before speculators builds its command line; run training through

    python -m vllm_hs.client.speculators_online --config config.yaml \\
        --hidden-states-backend vllm-hs --vllm-endpoint http://HOST:8000/v1 ...
    torchrun --nproc-per-node N -m vllm_hs.client.speculators_online ...   (same)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hs_connectors.transfer import (
    FileTransfer,
    HiddenStatesBackend,
    HiddenStatesTransfer,
)

from vllm_hs.client.responses import RefFetcher, decode

__all__ = ["BACKEND_NAME", "RefTransfer", "VllmHsBackend", "main"]

BACKEND_NAME = "vllm-hs"


class RefTransfer(HiddenStatesTransfer):
    """Reads the states that the ``kv_transfer_params`` of a patched server's
    response refer to (and, with ``cache_path``, extracted hs files first)."""

    def __init__(
        self,
        endpoint: str,
        cache_path: Path | None = None,
        mooncake: dict[str, Any] | None = None,
    ) -> None:
        self.fetch = RefFetcher(endpoint, mooncake=mooncake)
        self.files = FileTransfer(cache_path) if cache_path is not None else None
        self._urls: dict[str, str] = {}  # handle -> reference url, until deleted

    def get_cached(self, file_idx: int) -> dict[str, Any] | None:
        return self.files.get_cached(file_idx) if self.files is not None else None

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, Any]:
        import torch

        payload = hs_transfer_params.get("hidden_states")
        if payload is None:
            raise ValueError(
                "the server's kv_transfer_params hold no hidden states: start it "
                'with --hidden-states-config \'{..., "respond_in_kv_transfer_params":'
                " true}' (a patched vLLM, `vllm-hs wheel`)"
            )
        rows = decode(payload, self.fetch)
        handle = hs_transfer_params.get("handle")
        if payload.get("url") and handle is not None:
            self._urls[handle] = payload["url"]
        token_ids = torch.tensor(hs_transfer_params["token_ids"], dtype=torch.long)
        if rows.shape[0] != token_ids.shape[0]:
            raise ValueError(
                f"{rows.shape[0]} hidden-state rows for {token_ids.shape[0]} tokens "
                f"(request {hs_transfer_params.get('handle')})"
            )
        return {"hidden_states": rows, "token_ids": token_ids}

    def delete(self, handle: str) -> None:
        """Drop the server's reference (it would expire anyway)."""
        url = self._urls.pop(handle, None)
        if url is not None:
            self.fetch.delete(url)


def _add_path_argument(parser: argparse.ArgumentParser) -> None:
    # The file backend's option (same dest), so both can be registered.
    if any("--hidden-states-path" in a.option_strings for a in parser._actions):
        return
    parser.add_argument(
        "--hidden-states-path",
        type=str,
        default=None,
        help="Directory of extracted hs_{i}.safetensors files to read first.",
    )


@HiddenStatesBackend.register(BACKEND_NAME)
class VllmHsBackend(HiddenStatesBackend):
    """States a patched vLLM server's responses refer to."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        _add_path_argument(parser)
        parser.add_argument(
            "--vllm-hs-read-mooncake",
            action="store_true",
            help=(
                "vllm-hs backend: read the states from the server's Mooncake "
                "store (--hidden-states-ref-store mooncake; set it with the "
                "--mooncake-* options) instead of over HTTP."
            ),
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """The server needs no KV connector (see the module docstring)."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> RefTransfer:
        path = getattr(args, "hidden_states_path", None)
        endpoint = getattr(args, "vllm_endpoint", None) or "http://localhost:8000/v1"
        mooncake = None
        if getattr(args, "vllm_hs_read_mooncake", False):
            mooncake = mooncake_config(args)
        return RefTransfer(endpoint, Path(path) if path else None, mooncake)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        """None needed: the states come from `--hidden-states-config`."""
        return {}


def mooncake_config(args: argparse.Namespace) -> dict[str, Any]:
    """hs-connectors' `MooncakeStoreConfig` of speculators' --mooncake-* options,
    as its own Mooncake backend builds it."""
    import dataclasses

    from hs_connectors.transfer import MooncakeBackend

    store = MooncakeBackend.from_train_args(args, "").store
    return dataclasses.asdict(store.config)


def main() -> None:
    """speculators' training entry point, with this backend registered."""
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    train(TrainConfig.resolve())


if __name__ == "__main__":
    main()
