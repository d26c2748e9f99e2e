"""The writer thread of `vllm-hs extract`: checks each finished sample's states
(shape; NaN/Inf unless --no-validate), converts them to the stored dtype
(`vllm_hs.extract.storage`) and writes its sample file (in the trainer's
format, `vllm_hs.extract.formats`), so disk writes overlap engine work. The
engine loop (`vllm_hs.extract.loop`) submits `WriteJob`s and collects one
`WriteResult` per job.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from array import array
from pathlib import Path
from typing import Any

from vllm_hs.extract.formats import SampleFiles
from vllm_hs.extract.inputs import Sample
from vllm_hs.extract.records import Row
from vllm_hs.extract.storage import encode_states

__all__ = ["WriteJob", "WriteResult", "Writer"]


@dataclasses.dataclass
class WriteJob:
    """A finished sample, from the engine loop to the writer thread.

    ``states`` is the engine's tensor, unchecked: the writer checks it is
    [len(row.token_ids), K, H] (and finite, with validation) before writing.
    """

    sample: Sample
    states: Any
    """torch.Tensor [T, K, H], or None if the engine returned none."""
    row: Row
    """What dataset row ``sample.row`` will hold."""


@dataclasses.dataclass
class WriteResult:
    """The writer's answer to one `WriteJob`, in submission order.

    Exactly one of: written (``problem`` None, ``tokens`` and ``bytes`` > 0 unless
    the sample is empty), or not written (``problem`` says why; 0 and 0).
    """

    row: int
    index: int
    tokens: int = 0
    bytes: int = 0
    problem: str | None = None


class Writer:
    """Validates and writes samples on a background thread. ``done`` receives one
    `WriteResult` per submitted job; an exception in the thread is kept in
    ``error`` (and a result is still posted, so the main thread wakes up)."""

    def __init__(
        self,
        output: Path,
        layers: int,
        hidden: int,
        validate: bool,
        dtype: str,
        files: SampleFiles,
    ):
        self.output = output
        self.files = files
        self.layers = layers
        self.hidden = hidden
        self.validate = validate
        self.dtype = dtype
        """Stored dtype of hidden_states (`vllm_hs.extract.storage`)."""
        self.jobs: queue.Queue[WriteJob | None] = queue.Queue()
        self.done: queue.Queue[WriteResult] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._loop, name="vllm-hs-extract-writer", daemon=True
        )
        self.thread.start()

    def submit(self, job: WriteJob) -> None:
        self.jobs.put(job)

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self.done.put(self._write(job))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.error = e
                self.done.put(WriteResult(job.sample.row, job.sample.index))

    def _write(self, job: WriteJob) -> WriteResult:
        sample, (token_ids, mask, messages) = job.sample, job.row
        problem = _check_states(
            job.states, len(token_ids), len(mask), self.layers, self.hidden
        )
        if problem is None and self.validate and len(token_ids):
            bad = _first_non_finite(job.states)
            if bad is not None:
                problem = (
                    f"non-finite hidden states (first at row {bad[0]}, column {bad[1]})"
                )
        if problem is None:
            tensors, problem = encode_states(job.states, self.dtype)
        if problem:
            return WriteResult(sample.row, sample.index, problem=problem)
        size = self.files.save(
            self.files.path(self.output, sample.row, sample.index),
            tensors,
            _ids_tensor(token_ids),
            sample.index,
            mask,
            messages,
        )
        return WriteResult(sample.row, sample.index, len(token_ids), size)


def _check_states(
    states: Any, tokens: int, mask_len: int, layers: int, hidden: int
) -> str | None:
    """Why states of this shape must not be written, or None."""
    if states is None:
        return "the engine returned no hidden states"
    if states.dim() != 3:
        return f"hidden states have shape {list(states.shape)}, expected [T, K, H]"
    rows, k, h = states.shape
    if rows != tokens:
        return f"{rows} hidden-state rows for {tokens} tokens"
    if k != layers:
        return f"{k} layer columns, expected {layers}"
    if h != hidden:
        return f"hidden size {h}, expected {hidden}"
    if mask_len != tokens:
        return f"loss mask of {mask_len} for {tokens} tokens"
    return None


#: dtype -> (same-size integer dtype, exponent mask): a float is NaN or Inf
#: exactly when all its exponent bits are set.
_EXPONENT_BITS = {
    "float32": ("int32", 0x7F800000),
    "bfloat16": ("int16", 0x7F80),
    "float16": ("int16", 0x7C00),
}


def _first_non_finite(states: Any) -> tuple[int, int] | None:
    """(row, column) of the first NaN/Inf of a [T, K, H] tensor, or None.

    Runs in numpy: single-threaded, so the check does not fight the engine's
    OpenMP threads for the cores (torch.isfinite here made CPU extraction 4x
    slower on 2 cores). float32 and float16 take one summing pass first: a sum
    of finite values is finite unless it overflows, so only a non-finite sum
    (a NaN/Inf, or an overflow) pays for the exact scan of the raw bits.
    """
    import numpy as np
    import torch

    name = str(states.dtype).removeprefix("torch.")
    if name in ("float32", "float16"):
        values = states.contiguous().numpy()
        if np.isfinite(values.sum(dtype=np.float32)):
            return None
    if name in _EXPONENT_BITS:
        int_dtype, mask = _EXPONENT_BITS[name]
        bits = states.contiguous().view(getattr(torch, int_dtype)).numpy()
        bad = (bits & np.array(mask, dtype=bits.dtype)) == mask
    else:
        bad = ~np.isfinite(states.float().numpy())
    if not bad.any():
        return None
    row, column = np.argwhere(bad.any(axis=2))[0]
    return int(row), int(column)


def _ids_tensor(ids: array) -> Any:
    """token_ids as int64 torch tensor."""
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(ids, np.int32).astype(np.int64))
