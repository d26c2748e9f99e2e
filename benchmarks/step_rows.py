"""Per-step cost of a decode step's hidden-state rows across vLLM's two
process boundaries, without an engine.

A decode step with output states has one row per request. The script builds
such a step (one buffer, each request's rows a view of it, as the capturer
makes them) and times, per step:

* worker -> engine core, as `MessageQueue` pickles a worker's output
  (vLLM's `_reduce_tensor` for tensors) and the engine core unpickles it:
  ``per_tensor`` is a plain dict, every request's rows a tensor of its own
  (how rows crossed before patch 0022); ``packed`` is the `StepChunks` the
  capturer returns since 0022 (small rows as one tensor); ``captured``, the
  `StepChunks.packed` the capturer returns since 0024 for a step of small
  rows, built from the step's buffer in each call (a split into views until
  0025; since, views only where read in place) and pickled as that buffer,
  not packed again; on an accelerator the same since 0027 (after one copy of
  the buffer to the host, not timed here), while ``accelerator_0026`` is that
  worker's part before 0027, on the host: the buffer split into per-request
  views, concatenated again (the source of its one device-to-host copy),
  viewed per request and pickled as a `StepChunks` (packed again);
* engine core -> frontend, vLLM's msgpack encoder and decoder on the
  `EngineCoreOutputs` of that step: ``outputs``, one tensor per request (how
  rows crossed before patch 0023); ``outputs_packed``, the rows packed by the
  engine core's output thread (`pack_output_rows`, since 0023) and put back
  as views by the decoder. Both build the step's outputs in each call, as the
  scheduler does. A frontend that keeps the rows past the step (FINAL_ONLY)
  copies views of a pack out once every 16 outputs: not timed here.

Each timing repeats its call for at least ``--min-time`` seconds (garbage
collection off, as timeit does); rounds alternate the variants. Reported
per case: microseconds per step (median [min, max] over rounds),
packed / per_tensor and outputs_packed / outputs. Needs the patched wheel
(0023). Writes
``benchmarks/results/<vllm release>/step_rows.json``.

    python -m benchmarks.step_rows [--rounds 5]
"""

from __future__ import annotations

import argparse
import copyreg
import gc
import io
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    installed_versions,
    machine_facts,
    now,
    spread,
    write_script_result,
)

# (requests in the step, layers, hidden size, dtype): the tiny bench model's
# rows, and an 8B model's (Llama-3.1-8B: hidden 4096, bf16).
CASES = [
    (32, 4, 128, "float32"),
    (256, 4, 128, "float32"),
    (32, 4, 4096, "bfloat16"),
    (256, 4, 4096, "bfloat16"),
]
HEADLINE = (256, 4096)  # (requests, hidden) of the summary's case


def _pickle_round_trip(chunks: Any) -> Callable[..., Any]:
    """Pickle as `MessageQueue.enqueue` does, unpickle as `dequeue` does
    (`chunks`, or what the call is given)."""
    import torch
    from vllm.distributed.device_communicators.shm_broadcast import _reduce_tensor

    dispatch = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}

    def run(what: Any = chunks) -> Any:
        buffers: list[Any] = []
        with io.BytesIO() as bio:
            pickler = pickle.Pickler(
                bio, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffers.append
            )
            pickler.dispatch_table = dispatch
            pickler.dump(what)
            payload = bio.getvalue()
        return pickle.loads(payload, buffers=buffers)

    return run


def _step_order(chunks: dict[str, Any]) -> tuple[list[str], list[int], list[int]]:
    """The step's request ids, first positions and row counts, in order."""
    req_ids = list(chunks)
    starts = [start for start, _ in chunks.values()]
    counts = [rows.shape[0] for _, rows in chunks.values()]
    return req_ids, starts, counts


def _captured_round_trip(chunks: dict[str, Any], stacked: Any) -> Callable[[], Any]:
    """`StepChunks.packed` made from the step's buffer `stacked` (as
    `to_output` does since 0024; split into views there until 0025), then the
    pickle round trip."""
    from vllm.v1.hidden_states.step_chunks import StepChunks

    req_ids, starts, counts = _step_order(chunks)
    round_trip = _pickle_round_trip(None)

    def run() -> Any:
        return round_trip(StepChunks.packed(req_ids, starts, counts, stacked))

    return run


def _accelerator_0026_round_trip(
    chunks: dict[str, Any], stacked: Any
) -> Callable[[], Any]:
    """The worker's part of a decode step on an accelerator before 0027 (on
    the host): the step's buffer split into per-request views, concatenated
    again, viewed per request, then the pickle round trip of a `StepChunks`."""
    import torch
    from vllm.v1.hidden_states.step_chunks import StepChunks

    req_ids, starts, counts = _step_order(chunks)
    round_trip = _pickle_round_trip(None)

    def run() -> Any:
        tensors = torch.split(stacked, counts)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        host, offset = [], 0
        for t in tensors:
            n = t.numel()
            host.append(flat[offset : offset + n].view(t.shape))
            offset += n
        pairs = zip(starts, host, strict=True)
        return round_trip(StepChunks(dict(zip(req_ids, pairs, strict=True))))

    return run


def _outputs_round_trip(chunks: dict[str, Any], packed: bool) -> Callable[[], Any]:
    """The step's `EngineCoreOutputs` through vLLM's msgpack encoder and
    decoder, the small rows packed first when `packed` (the output thread's
    `pack_output_rows`; the decoder puts them back)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.hidden_states.output_packs import pack_output_rows
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    rows = [(req_id, rows) for req_id, (_, rows) in chunks.items()]
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    def run() -> Any:
        outputs = EngineCoreOutputs(
            outputs=[
                EngineCoreOutput(request_id=req_id, new_token_ids=[1], hidden_states=r)
                for req_id, r in rows
            ]
        )
        if packed:
            pack_output_rows(outputs)
        return decoder.decode([bytes(f) for f in encoder.encode(outputs)])

    return run


def _time(fn: Callable[[], Any], min_time: float) -> float:
    """Mean seconds per call, repeating for at least `min_time`, gc off."""
    fn()
    gc.collect()
    gc.disable()
    try:
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                return elapsed / calls
    finally:
        gc.enable()


def _step(
    requests: int, layers: int, hidden: int, dtype: str
) -> tuple[dict[str, Any], Any]:
    """The step's chunks (one row per request, views of one buffer) and that
    buffer."""
    import torch

    stacked = torch.randn(requests, layers, hidden).to(getattr(torch, dtype))
    chunks = {
        f"req-{i}": (100 + i, rows) for i, rows in enumerate(torch.split(stacked, 1))
    }
    return chunks, stacked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    from vllm.v1.hidden_states.step_chunks import StepChunks

    torch.set_num_threads(1)
    cases = []
    for requests, layers, hidden, dtype in CASES:
        chunks, stacked = _step(requests, layers, hidden, dtype)
        variants = {
            "per_tensor": _pickle_round_trip(dict(chunks)),
            "packed": _pickle_round_trip(StepChunks(chunks)),
            "captured": _captured_round_trip(chunks, stacked),
            "accelerator_0026": _accelerator_0026_round_trip(chunks, stacked),
            "outputs": _outputs_round_trip(chunks, packed=False),
            "outputs_packed": _outputs_round_trip(chunks, packed=True),
        }
        # The packed steps arrive equal.
        for name in ("packed", "captured", "accelerator_0026"):
            received = variants[name]()
            assert received.keys() == chunks.keys()
            assert all(
                received[k][0] == start and torch.equal(received[k][1], rows)
                for k, (start, rows) in chunks.items()
            )
        outputs = variants["outputs_packed"]().outputs
        assert [o.request_id for o in outputs] == list(chunks)
        assert all(
            torch.equal(o.hidden_states, rows)
            for o, (_, rows) in zip(outputs, chunks.values(), strict=True)
        )
        rounds: list[dict[str, float]] = []
        names = list(variants)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            timing = {name: _time(variants[name], args.min_time) for name in order}
            timing["ratio"] = timing["packed"] / timing["per_tensor"]
            timing["captured_ratio"] = timing["captured"] / timing["packed"]
            timing["accelerator_ratio"] = (
                timing["captured"] / timing["accelerator_0026"]
            )
            timing["outputs_ratio"] = timing["outputs_packed"] / timing["outputs"]
            timing["both_ratio"] = (timing["packed"] + timing["outputs_packed"]) / (
                timing["per_tensor"] + timing["outputs"]
            )
            rounds.append(timing)

        case = {
            "requests": requests,
            "layers": layers,
            "hidden": hidden,
            "dtype": dtype,
            "row_bytes": layers * hidden * getattr(torch, dtype).itemsize,
            "us_per_step": {
                name: spread([t[name] * 1e6 for t in rounds]) for name in names
            },
            "packed_over_per_tensor": spread([t["ratio"] for t in rounds]),
            "captured_over_packed": spread([t["captured_ratio"] for t in rounds]),
            "captured_over_accelerator_0026": spread(
                [t["accelerator_ratio"] for t in rounds]
            ),
            "outputs_packed_over_outputs": spread([t["outputs_ratio"] for t in rounds]),
            "both_hops_packed_over_per_tensor": spread(
                [t["both_ratio"] for t in rounds]
            ),
            "rounds": rounds,
        }
        cases.append(case)
        us = case["us_per_step"]
        print(
            f"{requests:4d} requests x {layers}x{hidden} {dtype:8s} worker->engine "
            f"core per_tensor {us['per_tensor']['median']:8.1f} us, packed "
            f"{us['packed']['median']:7.1f} us "
            f"({case['packed_over_per_tensor']['median']:.3f}), captured "
            f"{us['captured']['median']:7.1f} us (accelerator before 0027 "
            f"{us['accelerator_0026']['median']:7.1f} us); engine "
            f"core->frontend outputs {us['outputs']['median']:8.1f} us, packed "
            f"{us['outputs_packed']['median']:7.1f} us "
            f"({case['outputs_packed_over_outputs']['median']:.3f})",
            flush=True,
        )
    # The headline: a large batch of an 8B model's rows.
    headline = next(c for c in cases if (c["requests"], c["hidden"]) == HEADLINE)
    data = {
        "suite": "step_rows",
        "description": (__doc__ or "").strip(),
        "started": now(),
        "machine": machine_facts(),
        "versions": installed_versions(),
        "settings": {
            "model": f"rows {headline['layers']}x{headline['hidden']} "
            f"{headline['dtype']}, {headline['requests']} requests",
            "rounds": args.rounds,
            "min_time": args.min_time,
            "threads": 1,
        },
        "summary": {
            "metric": "both hops per decode step, packed / one tensor per request",
            **headline["both_hops_packed_over_per_tensor"],
            "aim": None,
            "higher_is_better": False,
        },
        "rounds": headline["rounds"],
        "cases": cases,
    }
    print("->", write_script_result(data, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
