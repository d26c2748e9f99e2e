"""Cost of the server's hidden-state response path, without a server.

For tensors ``[rows, layers, hidden]`` in fp32 and bf16 it times, in the
process, what the OpenAI-compatible server and a client do per payload:

* ``base64``: ``encode_hidden_states(t, layers, "base64")`` (the server's
  encoder) plus ``HiddenStatesPayload.model_dump_json()``;
* ``float``: the same with ``"float"`` (nested JSON lists); the biggest cases
  are skipped (and listed) when all their float calls would take more than
  ``--float-max-seconds``;
* ``decode``: the client side, ``vllm_hs.client.decode(json.loads(text))`` of
  the base64 JSON text.

Every round runs every case's variants one after the other, in an order that
rotates from round to round; each timing repeats its call until at least
``--min-time`` seconds have passed (garbage collection off while timing, as
timeit does) and keeps the mean per call. Reported per case: raw tensor bytes
per second (median [min, max] over the rounds), JSON size / raw size, and the
throughput ratio base64 / float per round. Results (machine facts, versions,
settings, every round) go to
``benchmarks/results/<release>/response_encoding.json``; a Markdown table is
printed.

    python -m benchmarks run response_encoding [--quick]
"""

from __future__ import annotations

import gc
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, Summary, spread
from benchmarks.rounds import rotation

VARIANTS = ("base64", "float", "decode")
HEADLINE = {"rows": 256, "hidden": 4096, "dtype": "float32"}


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


@dataclass
class EncodingSettings:
    rows: list[int] = option(
        [16, 256, 2048], "rows per payload, comma-separated", parse=parse_ints
    )
    hidden: list[int] = option(
        [128, 4096], "hidden sizes, comma-separated", parse=parse_ints
    )
    dtypes: str = option("float32,bfloat16", "dtypes, comma-separated")
    layers: int = option(4, "layers per payload")
    rounds: int = option(5, "")
    min_time: float = option(0.1, "seconds per timing (repeats)")
    float_max_seconds: float = option(
        10.0, "skip a float case whose calls would take longer than this in all"
    )
    quick: bool = option(False, "")

    def __post_init__(self) -> None:
        if self.quick:
            self.rows = [r for r in self.rows if r <= 256] or [16]
            self.rounds = min(self.rounds, 3)
            self.min_time = min(self.min_time, 0.05)
            self.float_max_seconds = min(self.float_max_seconds, 3.0)

    @property
    def dtype_names(self) -> list[str]:
        return [d.strip() for d in self.dtypes.split(",") if d.strip()]


def time_call(fn: Callable[[], Any], repeats: int) -> float:
    """Mean seconds per call over `repeats` calls, gc off."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        elapsed = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed / repeats


def facts() -> tuple[dict[str, Any], dict[str, Any]]:
    """(machine, versions) beside the runner's: the cores and threads this
    process may use, and the libraries that encode and decode."""
    import os

    import pybase64
    import pydantic
    import torch
    import vllm

    machine: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    try:
        machine["usable_cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": getattr(vllm, "__version__", "unknown"),
        "pybase64": getattr(pybase64, "__version__", "unknown"),
        "pydantic": pydantic.VERSION,
    }
    return machine, versions


class Case:
    def __init__(self, rows: int, layers: int, hidden: int, dtype_name: str) -> None:
        import torch
        from vllm.entrypoints.openai.hidden_states import encode_hidden_states

        from vllm_hs.client import decode

        self.rows, self.layers, self.hidden, self.dtype = (
            rows,
            layers,
            hidden,
            dtype_name,
        )
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(rows * 131 + hidden)
        self.tensor = (torch.randn(rows, layers, hidden, generator=g) * 4).to(dtype)
        self.layer_ids: list[int | str] = [*range(layers - 1), "final_norm"]
        self.raw_bytes = self.tensor.numel() * self.tensor.element_size()
        self._encode = encode_hidden_states
        self._decode = decode
        self.b64_text = self.encode("base64")
        out = decode(json.loads(self.b64_text))
        assert out.dtype == self.tensor.dtype and torch.equal(out, self.tensor)
        self.sizes: dict[str, int] = {"base64": len(self.b64_text.encode())}
        self.repeats: dict[str, int] = {}
        self.seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
        self.skipped: dict[str, str] = {}

    @property
    def name(self) -> str:
        return f"{self.dtype} {self.rows}x{self.layers}x{self.hidden}"

    def encode(self, encoding: str) -> str:
        return self._encode(self.tensor, self.layer_ids, encoding).model_dump_json()

    def op(self, variant: str) -> Callable[[], Any]:
        if variant == "decode":
            text = self.b64_text
            return lambda: self._decode(json.loads(text))
        return lambda: self.encode(variant)

    def calibrate(self, variant: str, min_time: float) -> float:
        """Warm up, check the result, and set the repeats so that one timing
        lasts about `min_time` (as timeit.autorange); returns seconds per call."""
        import torch

        fn = self.op(variant)
        result = fn()  # warm-up (imports, caches)
        if variant == "float":
            self.sizes["float"] = len(result.encode())
            out = self._decode(json.loads(result))
            assert torch.equal(out, self.tensor), "float payload does not round-trip"
        del result
        repeats = 1
        while True:
            per_call = time_call(fn, repeats)
            if per_call * repeats >= min_time / 5 or repeats >= 10_000:
                break
            repeats *= 5
        self.repeats[variant] = max(1, min(10_000, round(min_time / per_call)))
        return per_call


def run(args: EncodingSettings) -> dict[str, Any]:
    cases = [
        Case(rows, args.layers, hidden, dtype)
        for dtype in args.dtype_names
        for hidden in sorted(args.hidden)
        for rows in sorted(args.rows)
    ]
    cases.sort(key=lambda c: c.raw_bytes)
    # Everything alive now (vllm, torch, the inputs) moves out of the
    # collector's sight: the gc.collect() before each timing stays cheap.
    gc.collect()
    gc.freeze()
    # Float cases run in size order; a case is skipped when its calls (warm-up,
    # calibration, rounds) would take over --float-max-seconds in all, as
    # predicted from the slowest seconds per element seen so far (x1.5).
    float_s_per_element = 0.0
    float_calls = args.rounds + 2
    for case in cases:
        numel = case.tensor.numel()
        for variant in VARIANTS:
            if variant == "float" and float_s_per_element:
                predicted = 1.5 * float_s_per_element * numel * float_calls
                if predicted > args.float_max_seconds:
                    case.skipped["float"] = (
                        f"predicted {predicted:.0f} s for {float_calls} calls > "
                        f"--float-max-seconds {args.float_max_seconds:g}"
                    )
                    continue
            once = case.calibrate(variant, args.min_time)
            if variant == "float":
                float_s_per_element = max(float_s_per_element, once / numel)
        print(f"  calibrated {case.name}: repeats {case.repeats}", flush=True)

    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for case in cases:
            order = rotation([v for v in VARIANTS if v in case.repeats], r)
            seconds = {}
            for variant in order:
                seconds[variant] = time_call(case.op(variant), case.repeats[variant])
                case.seconds[variant].append(seconds[variant])
            rounds.append(
                {
                    "round": r,
                    "case": case.name,
                    "order": order,
                    "repeats": {v: case.repeats[v] for v in order},
                    "seconds": seconds,
                }
            )
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return {"cases": cases, "rounds": rounds}


def case_result(case: Case) -> dict[str, Any]:
    variants = {}
    for variant, seconds in case.seconds.items():
        if not seconds:
            continue
        variants[variant] = {
            "seconds": seconds,
            "seconds_stats": spread(seconds),
            "raw_bytes_per_s": spread([case.raw_bytes / s for s in seconds]),
            "repeats": case.repeats[variant],
        }
    result: dict[str, Any] = {
        "name": case.name,
        "rows": case.rows,
        "layers": case.layers,
        "hidden": case.hidden,
        "dtype": case.dtype,
        "raw_bytes": case.raw_bytes,
        "json_bytes": case.sizes,
        "size_ratio": {k: v / case.raw_bytes for k, v in case.sizes.items()},
        "variants": variants,
        "skipped": case.skipped,
    }
    if case.seconds["float"]:
        ratios = [
            f / b
            for b, f in zip(case.seconds["base64"], case.seconds["float"], strict=True)
        ]
        result["base64_over_float_throughput"] = {"rounds": ratios, **spread(ratios)}
    return result


def headline(results: list[dict[str, Any]]) -> Summary | None:
    with_float = [c for c in results if "base64_over_float_throughput" in c]
    if not with_float:
        return None
    chosen = next(
        (c for c in with_float if all(c[k] == v for k, v in HEADLINE.items())),
        max(with_float, key=lambda c: c["raw_bytes"]),
    )
    ratio = chosen["base64_over_float_throughput"]
    return Summary(
        metric=f"base64 / float encode throughput ({chosen['name']})",
        higher_is_better=True,
        aim=None,
        median=ratio["median"],
        min=ratio["min"],
        max=ratio["max"],
    )


def fmt_rate(block: dict[str, Any] | None) -> str:
    if block is None:
        return "skipped"
    s = block["raw_bytes_per_s"]
    mb = 1e6
    return f"{s['median'] / mb:,.0f} [{s['min'] / mb:,.0f}, {s['max'] / mb:,.0f}]"


def size_cell(case: dict[str, Any], variant: str) -> str:
    ratio = case["size_ratio"].get(variant)
    return "-" if ratio is None else f"{ratio:.2f}"


def markdown(results: list[dict[str, Any]], rounds: int) -> str:
    lines = [
        f"Raw tensor MB/s, median [min, max] over {rounds} rounds; size = JSON "
        "bytes / raw bytes.",
        "",
        "| dtype | rows x layers x hidden | raw MiB | base64 size | float size "
        "| encode base64 MB/s | encode float MB/s | decode base64 MB/s "
        "| base64 / float |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results:
        v = c["variants"]
        ratio = c.get("base64_over_float_throughput")
        lines.append(
            f"| {c['dtype']} | {c['rows']}x{c['layers']}x{c['hidden']} "
            f"| {c['raw_bytes'] / 2**20:.3g} "
            f"| {c['size_ratio']['base64']:.3f} "
            f"| {size_cell(c, 'float')} "
            f"| {fmt_rate(v.get('base64'))} | {fmt_rate(v.get('float'))} "
            f"| {fmt_rate(v.get('decode'))} | "
            + (
                f"{ratio['median']:.1f}x [{ratio['min']:.1f}, {ratio['max']:.1f}]"
                if ratio
                else "-"
            )
            + " |"
        )
    return "\n".join(lines)


def measure(args: EncodingSettings) -> list[Result]:
    print(
        f"response encoding: rows {args.rows}, hidden {args.hidden}, {args.dtype_names}"
    )
    machine, versions = facts()
    outcome = run(args)
    results = [case_result(c) for c in outcome["cases"]]
    summary = headline(results)
    print()
    print(markdown(results, args.rounds))
    if summary is not None:
        s = summary
        print(f"\n{s.metric}: {s.median:.1f}x [{s.min:.1f}, {s.max:.1f}]")
    result = Result(
        suite="response_encoding",
        description=(
            "Server response path of hidden states: encode_hidden_states + "
            "HiddenStatesPayload.model_dump_json (base64, float) and client "
            "vllm_hs.client.decode(json.loads(base64 JSON)); raw tensor bytes/s."
        ),
        settings={
            "rows": args.rows,
            "hidden": args.hidden,
            "dtypes": args.dtype_names,
            "layers": args.layers,
            "rounds": args.rounds,
            "min_time_s": args.min_time,
            "float_max_seconds": args.float_max_seconds,
            "float_skip_rule": "skip when 1.5 x slowest s/element so far x elements "
            "x (rounds + 2) > float_max_seconds",
            "quick": args.quick,
            "timing": "mean per call over repeats (>= min_time_s), gc off; "
            "variant order rotates each round",
        },
        rounds=outcome["rounds"],
        summary=summary,
        extra={"cases": results},
        machine=machine,
        versions=versions,
    )
    return [result]
