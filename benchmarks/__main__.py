"""Regression benchmarks per vLLM release.

    python -m benchmarks run [--suites capture,transport,overhead] [--model large]
    python -m benchmarks compare OLD.json NEW.json [--threshold 0.05]
    python -m benchmarks report

`run` writes benchmarks/results/<vllm-release>/<suite>.json (machine, versions,
settings, every round) and regenerates the Markdown table and chart; `compare`
exits 1 when a ratio got worse than the threshold, to gate a release bump.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_ROOT,
    has_channel,
    installed_versions,
    machine_facts,
    vllm_release,
    write_result,
)


def cmd_run(args: argparse.Namespace) -> int:
    from benchmarks.report import write_report
    from benchmarks.suites import SUITES, Settings

    settings = Settings(
        model=args.model,
        mode=args.mode,
        prompts=args.prompts,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        dtype=args.dtype,
        eager=not args.compile,
        unpatched_python=args.unpatched_python,
        load_format=args.load_format,
    )
    versions = installed_versions()
    if not versions.get("patched") and has_channel(sys.executable):
        versions["patched"] = "unmarked development tree (no vllm-hs marker)"
    if not versions.get("patched"):
        print(f"the importable vllm is not patched: {versions}", file=sys.stderr)
        return 2
    if args.unpatched_python:
        versions["unpatched"] = installed_versions(args.unpatched_python)
    release = vllm_release(versions)
    machine = machine_facts()
    for name in args.suites.split(","):
        print(f"== {name} ({release}, model {settings.model})", flush=True)
        load_before = os.getloadavg()
        produced = SUITES[name](settings)
        if produced is None:
            continue
        # A suite may give several figures from the same runs (a list).
        results = produced if isinstance(produced, list) else [produced]
        load_after = os.getloadavg()
        for result in results:
            result.load_average = {"before": load_before, "after": load_after}
            result.machine = machine
            result.versions = versions
            path = write_result(result, release, args.out)
            s = result.summary
            print(
                f"{result.suite}: {s.metric}: median {s.median:.4f} "
                f"[min {s.min:.4f}, max {s.max:.4f}] -> {path}",
                flush=True,
            )
    write_report(args.out or RESULTS_ROOT)
    return 0


def compare_summaries(
    old: dict[str, Any], new: dict[str, Any], threshold: float
) -> tuple[str, float]:
    """The gate's verdict on two suite summaries ({median, min, max,
    higher_is_better}) and the relative change of the median (positive: better).

    "worse" needs both: the median lost more than `threshold`, and the new
    median lies outside the old run's [min, max] on the losing side (a drop
    that the old run's own spread covers is noise on these machines, not a
    regression). "noisy": the median lost more than `threshold` but within the
    old spread; rerun with more rounds before trusting it. "ok" otherwise.
    """
    o, n = old["median"], new["median"]
    higher = new["higher_is_better"]
    change = (n - o) / o if higher else (o - n) / o
    if change >= -threshold:
        return "ok", change
    outside = n < old["min"] if higher else n > old["max"]
    return ("worse" if outside else "noisy"), change


def cmd_compare(args: argparse.Namespace) -> int:
    old = json.loads(Path(args.old).read_text())
    new = json.loads(Path(args.new).read_text())
    if old["suite"] != new["suite"]:
        print(f"different suites: {old['suite']} vs {new['suite']}", file=sys.stderr)
        return 2
    o, n = old["summary"], new["summary"]
    verdict, change = compare_summaries(o, n, args.threshold)
    print(
        f"{new['suite']}: {n['metric']}: {o['median']:.4f} [{o['min']:.4f}, "
        f"{o['max']:.4f}] -> {n['median']:.4f} [{n['min']:.4f}, {n['max']:.4f}] "
        f"({change:+.1%}, threshold -{args.threshold:.0%}): {verdict}"
    )
    return 1 if verdict == "worse" else 0


def cmd_report(args: argparse.Namespace) -> int:
    from benchmarks.report import write_report

    print(write_report(args.out or RESULTS_ROOT))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run suites, write results, refresh the report")
    run.add_argument(
        "--suites",
        default="capture,transport,native,overhead,overhead_config",
        help="comma-separated suites (default: %(default)s)",
    )
    run.add_argument(
        "--model",
        default="large",
        help="tiny: seeded hidden 128, 4 layers; large: seeded hidden 512, 8 "
        "layers, vocab 8192; or a model directory, e.g. a real model's config "
        "with --load-format dummy on a GPU (default: %(default)s)",
    )
    run.add_argument(
        "--load-format",
        default="auto",
        help="vLLM load_format; 'dummy' needs only config.json (default: auto)",
    )
    run.add_argument(
        "--mode",
        choices=["mp", "inproc"],
        default="mp",
        help="engine mode (default: vLLM's multiprocess engine)",
    )
    run.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    run.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    run.add_argument("--max-tokens", type=int, default=32, help="tokens generated")
    run.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    run.add_argument("--dtype", default="bfloat16", help="engine dtype")
    run.add_argument(
        "--compile",
        action="store_true",
        help="use the compiled engine instead of enforce_eager",
    )
    run.add_argument(
        "--unpatched-python",
        default=None,
        help="python of an environment with the UNPATCHED wheel of the "
        "same release (needed by the overhead suite)",
    )
    run.add_argument(
        "--out", type=Path, default=None, help=f"results root (default: {RESULTS_ROOT})"
    )
    run.set_defaults(handler=cmd_run)
    compare = sub.add_parser(
        "compare",
        help="gate: exit 1 if NEW is worse than OLD beyond the threshold and "
        "outside OLD's min-max spread",
    )
    compare.add_argument("old")
    compare.add_argument("new")
    compare.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="allowed relative loss (default: %(default)s)",
    )
    compare.set_defaults(handler=cmd_compare)
    report = sub.add_parser("report", help="regenerate the Markdown table and chart")
    report.add_argument("--out", type=Path, default=None)
    report.set_defaults(handler=cmd_report)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
