"""Hidden-state references from the server's store to a reader, per store,
against memcpy in the same run.

A reference leaves the server through its store: the API server process that
built the response puts the rows there, and the reader (a trainer) takes them
out. Each round runs every way once, in an order that rotates from round to
round, on the same ``--size-mib`` MiB of rows (4 layers of an 8B-wide model,
bf16):

* ``memcpy``: a copy of the rows into a buffer of this process, allocated and
  touched beforehand (the machine's copy rate);
* ``shm``: the patched install's `ShmRefStore.put` (the file written in its
  tmpfs directory, as `vllm serve` does) and a reader in another process that
  maps the file (`vllm_hs.client.map_safetensors`, as `vllm_hs.client` reads a
  co-located reference: the rows in the reader's address space without a
  copy) and touches every page of it;
* ``mooncake``: `MooncakeRefStore.put` into a real `mooncake_master` on
  loopback, and the reader getting the object with hs-connectors'
  `MooncakeHiddenStatesStore.get_sample(manifest)`, as a trainer on another
  node does (over TCP here; RDMA where the hosts have it).

A way's rate is the rows' bytes over the time from the start of the put to the
reader holding the rows (its own copy for Mooncake, as hs-connectors' reader
returns them; every page mapped for shm). The figures: each store's rate over
memcpy's in the same round (aim for shm: 0.5). How long `/health` answers
while a 256 MiB reference is made through the whole server is the `payload`
suite's `payload_health`.

    python -m benchmarks run ref_store [--size-mib 256] [--rounds 5] [--quick]
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, summarize
from benchmarks.rounds import run_rounds

WAYS = ("memcpy", "shm", "mooncake")
LAYERS = 4
HIDDEN = 4096
SHM_AIM = 0.5

READER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from vllm_hs.client import map_safetensors
    config = json.loads(sys.argv[1])
    store = None
    if config:
        from hs_connectors.mooncake_store import (
            MooncakeHiddenStatesStore, MooncakeStoreConfig)
        store = MooncakeHiddenStatesStore(
            MooncakeStoreConfig.from_dict(config)).setup()
    print("ready", flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if "path" in ask:
            rows = map_safetensors(ask["path"])["hidden_states"]
            # Mapped, not copied: touch every page, so all of it is present.
            int(rows.reshape(-1).view(torch.uint8)[::4096].sum())
        else:
            rows = store.get_sample(ask["manifest"])["hidden_states"]
        print(rows.numel() * rows.element_size(), flush=True)
    """
)


@dataclass
class RefStoreSettings:
    size_mib: int = option(256, "MiB of rows per reference")
    rounds: int = option(5, "")
    quick: bool = option(False, "a smoke run: 16 MiB, 2 rounds")

    def __post_init__(self) -> None:
        if self.quick:
            self.size_mib = min(self.size_mib, 16)
            self.rounds = min(self.rounds, 2)


class _Reader:
    """A reader process: asked for a reference, answers once it holds a copy."""

    def __init__(self, mooncake: dict[str, Any] | None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", READER, json.dumps(mooncake or {})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the reader process did not start")

    def read(self, ask: dict[str, Any]) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _timed(action: Callable[[], int]) -> Callable[[], dict[str, Any]]:
    def timed() -> dict[str, Any]:
        start = time.perf_counter()
        nbytes = action()
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "bytes": nbytes,
            "mib_per_s": nbytes / seconds / 2**20,
        }

    return timed


def _through(
    store: Any,
    reader: _Reader,
    rows: Any,
    layers: list[int | str],
    ask: Callable[[Any], dict[str, Any]],
) -> Callable[[], int]:
    """One reference of `rows` put into `store`, read by `reader` (asked
    with `ask(reference)`), then deleted: the bytes read."""

    def way() -> int:
        ref = store.put(rows, layers)
        read = reader.read(ask(ref))
        store.delete(ref.ref_id)
        return read

    return way


def measure(args: RefStoreSettings) -> list[Result]:
    import torch
    from vllm.entrypoints.openai import hidden_states_refs as refs

    from vllm_hs_testing.mooncake import MooncakeMaster, unavailable_reason

    nbytes = args.size_mib << 20
    rows = torch.randn(nbytes // (LAYERS * HIDDEN * 2), LAYERS, HIDDEN).to(
        torch.bfloat16
    )
    layers: list[int | str] = list(range(LAYERS))
    work = Path(tempfile.mkdtemp(prefix="hs-ref-store-"))
    shm = refs.ShmRefStore(600, 4 * nbytes)  # a new /dev/shm directory
    target = torch.empty_like(rows).fill_(0)  # preallocated and touched

    def memcpy() -> int:
        target.copy_(rows)
        return target.numel() * target.element_size()

    ways: dict[str, Callable[[], dict[str, Any]]] = {"memcpy": _timed(memcpy)}
    reason = unavailable_reason()
    if reason is not None:
        print(f"ref_store: the mooncake way is left out: {reason}", flush=True)
    with contextlib.ExitStack() as stack:
        stack.callback(shm.close)
        shm_reader = _Reader(None)
        stack.callback(shm_reader.close)

        ways["shm"] = _timed(
            _through(shm, shm_reader, rows, layers, lambda ref: {"path": ref.path})
        )
        if reason is None:
            master = stack.enter_context(MooncakeMaster(work / "master.log"))
            segment = 3 * nbytes + (64 << 20)
            mooncake = refs.make_ref_store(
                "mooncake", master.store_config(segment), 600, 2 * nbytes
            )
            stack.callback(mooncake.close)
            reader_config = master.store_config(0) | {"local_buffer_size": segment}
            mooncake_reader = _Reader(reader_config)
            stack.callback(mooncake_reader.close)
            ways["mooncake"] = _timed(
                _through(
                    mooncake,
                    mooncake_reader,
                    rows,
                    layers,
                    lambda ref: {"manifest": ref.manifest},
                )
            )
        for way in ways.values():  # warm-up: buffers, first mappings
            way()
        rounds = []
        for r, row in enumerate(run_rounds(args.rounds, ways)):
            rounds.append({"order": list(row), **row})
            print(
                f"round {r}: "
                + ", ".join(f"{w} {e['mib_per_s']:.0f} MiB/s" for w, e in row.items()),
                flush=True,
            )
    for row in rounds:
        for way in ways:
            if way != "memcpy":
                row[f"{way}_over_memcpy"] = (
                    row[way]["mib_per_s"] / row["memcpy"]["mib_per_s"]
                )
    settings = {
        "size_mib": args.size_mib,
        "rows": list(rows.shape),
        "dtype": "bfloat16",
        "rounds": args.rounds,
        "shm_directory": "tmpfs (/dev/shm)",
        "mooncake": "mooncake-transfer-engine-non-cuda, TCP on loopback, master "
        "and both clients on this host",
    }
    how = {
        "shm": (
            "the shm store: put by the server's store, mapped by a reader process "
            "(every page touched)",
            "shm store",
            SHM_AIM,
        ),
        "mooncake": (
            "a Mooncake Store (TCP on loopback): put by the server's store, read "
            "by hs-connectors' reader in another process",
            "Mooncake store",
            None,
        ),
    }
    return [
        Result(
            suite=f"ref_store_{way}",
            description=f"{args.size_mib} MiB reference through {through}; rate "
            "over memcpy of the same rows in the same round",
            settings=settings,
            rounds=rounds,
            summary=summarize(
                [row[f"{way}_over_memcpy"] for row in rounds],
                metric=f"{store} rate / memcpy",
                higher_is_better=True,
                aim=aim,
            ),
        )
        for way, (through, store, aim) in how.items()
        if way in ways
    ]
