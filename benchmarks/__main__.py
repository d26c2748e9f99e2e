"""Regression benchmarks per vLLM release.

    python -m benchmarks run [SUITE ...] [--suites LIST] [options]
    python -m benchmarks list
    python -m benchmarks compare OLD.json NEW.json [--threshold 0.05]
    python -m benchmarks report

`run` measures the suites named (default: capture, transport, native,
overhead, overhead_config), writes benchmarks/results/<vllm-release>/<suite>.json
(machine, versions, settings, every round) and regenerates the Markdown table
and chart. Every option is some suite's setting; one left out keeps each
suite's own default (`list` shows each suite's sides and settings). `--quick`
gives the smallest settings of the suites that offer them. `compare` exits 1
when a ratio got worse than the threshold, to gate a release bump.

Examples:

    python -m benchmarks run capture decode --model tiny --rounds 2
    python -m benchmarks run --unpatched-python ENV/bin/python --suites overhead
    python -m benchmarks run extraction --model large
    python -m benchmarks run payload --quick --no-write
    python -m benchmarks run acceptance --quick
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.protocol import shared_options
from benchmarks.result import RESULTS_ROOT


def add_suite_options(parser: argparse.ArgumentParser) -> None:
    """Every suite's options, once each (see benchmarks.protocol)."""
    from benchmarks.suites import SUITES

    group = parser.add_argument_group("suite settings (default: each suite's own)")
    for option, users in shared_options(SUITES.values()).values():
        helps = [
            o.help for s in users for o in SUITES[s].options() if o.name == option.name
        ]
        text = next((h for h in helps if h), "")
        where = ", ".join(users) if len(users) < 6 else f"{len(users)} suites"
        kwargs: dict[str, Any] = {"dest": option.name, "default": None}
        if option.parse is None:
            kwargs.update(action="store_const", const=not option.default)
        else:
            kwargs.update(type=option.parse, metavar=option.name.upper())
        group.add_argument(option.flag, help=f"{text} [{where}]", **kwargs)


def cmd_run(args: argparse.Namespace) -> int:
    from benchmarks.runner import run_suites
    from benchmarks.suites import DEFAULT_SUITES, SUITES

    names = list(args.names)
    if args.suites:
        names += [n for n in args.suites.split(",") if n]
    unknown = sorted(set(names) - set(SUITES))
    if unknown:
        print(f"unknown suites {unknown}; `python -m benchmarks list`", file=sys.stderr)
        return 2
    given = {
        k: v
        for k, v in vars(args).items()
        if k not in ("names", "suites", "out", "no_write", "handler", "command")
    }
    suites = [SUITES[n] for n in names or DEFAULT_SUITES]
    return run_suites(suites, given, args.out, write=not args.no_write)


def cmd_list(args: argparse.Namespace) -> int:
    from benchmarks.suites import DEFAULT_SUITES, SUITES

    for suite in SUITES.values():
        default = " (default)" if suite.name in DEFAULT_SUITES else ""
        print(f"{suite.name}{default}: {suite.about}")
        print(f"    sides: {', '.join(suite.sides)}")
        settings = ", ".join(
            f"{o.flag} ({'on' if o.default else 'off'})"
            if o.parse is None and o.flag != "--compile"
            else f"{o.flag} (off)"
            if o.parse is None
            else f"{o.flag} {o.default!r}"
            for o in suite.options()
        )
        print(f"    settings: {settings}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from benchmarks.gate import compare_files

    return compare_files(Path(args.old), Path(args.new), args.threshold)


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
    run.add_argument("names", nargs="*", metavar="SUITE", help="suites to run")
    run.add_argument("--suites", default=None, help="comma-separated suites")
    run.add_argument(
        "--out", type=Path, default=None, help=f"results root (default: {RESULTS_ROOT})"
    )
    run.add_argument(
        "--no-write", action="store_true", help="print only: no result files, no report"
    )
    add_suite_options(run)
    run.set_defaults(handler=cmd_run)
    listing = sub.add_parser("list", help="the suites, their sides and settings")
    listing.set_defaults(handler=cmd_list)
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
