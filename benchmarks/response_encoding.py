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
``benchmarks/results/v0.32.0/response_encoding.json``; a Markdown table is
printed.

    PYTHONPATH=. python benchmarks/response_encoding.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "benchmarks" / "results" / "v0.32.0" / "response_encoding.json"
VARIANTS = ("base64", "float", "decode")
HEADLINE = {"rows": 256, "hidden": 4096, "dtype": "float32"}


def parse_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=parse_ints, default=[16, 256, 2048])
    parser.add_argument("--hidden", type=parse_ints, default=[128, 4096])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=4, help="layers per payload")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--min-time", type=float, default=0.1, help="seconds per timing (repeats)"
    )
    parser.add_argument(
        "--float-max-seconds",
        type=float,
        default=10.0,
        help="skip a float case whose calls would take longer than this in all",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="rows 16,256, 3 rounds, 0.05 s timings, float cases up to 3 s",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows = [r for r in args.rows if r <= 256] or [16]
        args.rounds = min(args.rounds, 3)
        args.min_time = min(args.min_time, 0.05)
        args.float_max_seconds = min(args.float_max_seconds, 3.0)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    return args


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


def stats(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def facts() -> tuple[dict[str, Any], dict[str, Any]]:
    """(machine, versions)."""
    import pybase64
    import pydantic
    import torch
    import vllm

    from vllm_hs.patched_vllm import is_patched

    try:
        from benchmarks.common import machine_facts

        machine = machine_facts()
    except ImportError:
        machine = {"cores": None, "platform": platform.platform()}
    try:
        import os

        machine["usable_cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    machine["torch_threads"] = torch.get_num_threads()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": getattr(vllm, "__version__", "unknown"),
        "vllm_patched": is_patched(vllm),
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases = [
        Case(rows, args.layers, hidden, dtype)
        for dtype in args.dtypes
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
            variants = [v for v in VARIANTS if v in case.repeats]
            shift = r % len(variants)
            order = variants[shift:] + variants[:shift]
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
            "seconds_stats": stats(seconds),
            "raw_bytes_per_s": stats([case.raw_bytes / s for s in seconds]),
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
        result["base64_over_float_throughput"] = {"rounds": ratios, **stats(ratios)}
    return result


def headline(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    with_float = [c for c in results if "base64_over_float_throughput" in c]
    if not with_float:
        return None
    chosen = next(
        (c for c in with_float if all(c[k] == v for k, v in HEADLINE.items())),
        max(with_float, key=lambda c: c["raw_bytes"]),
    )
    ratio = chosen["base64_over_float_throughput"]
    return {
        "metric": f"base64 / float encode throughput ({chosen['name']})",
        "higher_is_better": True,
        "aim": None,
        "median": ratio["median"],
        "min": ratio["min"],
        "max": ratio["max"],
    }


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    machine, versions = facts()
    if not versions["vllm_patched"]:
        print("the importable vllm is not patched (no hidden states)", file=sys.stderr)
        return 2
    print(f"response encoding: rows {args.rows}, hidden {args.hidden}, {args.dtypes}")
    outcome = run(args)
    results = [case_result(c) for c in outcome["cases"]]
    document = {
        "suite": "response_encoding",
        "description": (
            "Server response path of hidden states: encode_hidden_states + "
            "HiddenStatesPayload.model_dump_json (base64, float) and client "
            "vllm_hs.client.decode(json.loads(base64 JSON)); raw tensor bytes/s."
        ),
        "started": started,
        "seconds": time.perf_counter() - t0,
        "machine": machine,
        "versions": versions,
        "settings": {
            "rows": args.rows,
            "hidden": args.hidden,
            "dtypes": args.dtypes,
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
        "cases": results,
        "rounds": outcome["rounds"],
    }
    summary = headline(results)
    if summary is not None:  # the headline ratio, as benchmarks/report.py reads it
        document["summary"] = summary
    table = markdown(results, args.rounds)
    print()
    print(table)
    if summary is not None:
        s = summary
        print(f"\n{s['metric']}: {s['median']:.1f}x [{s['min']:.1f}, {s['max']:.1f}]")
    print(f"\n{document['seconds']:.0f} s")
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
