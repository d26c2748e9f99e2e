"""The `vllm-hs` command line: assembles the subcommands' parsers and dispatches.

One subcommand per module, vLLM style. Adding a subcommand: write a module with

    def add_parser(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("name", help="...", description="...")
        parser.add_argument(...)            # a help= for every flag
        parser.set_defaults(handler=run)    # run(args: argparse.Namespace) -> int

and list it in SUBCOMMAND_MODULES. Exit codes, the parser class and shared
options come from `vllm_hs.command`. `run` returns the exit status and raises
VllmHsError for failures the user should read as one message (UsageError for a
value on the command line that cannot be used: exit status 2). Every listed module
is imported to build `--help`, so import heavy dependencies (vllm, torch) inside
`run`, not at module level.

Messages go through `logging` (logger ``vllm_hs.<module>``, shown on stderr as
``vllm-hs: <message>``); stdout carries only a command's result (a path, a report,
JSON).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vllm_hs import __version__
from vllm_hs.command import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    ArgumentParser,
    configure_logging,
)
from vllm_hs.errors import UsageError, VllmHsError

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "vllm_hs.series.apply",
    "vllm_hs.series.wheel",
    "vllm_hs.series.status",
    "vllm_hs.demo",
    "vllm_hs.extract.cli",
    "vllm_hs.series.stage",
    "vllm_hs.series.refresh",
    "vllm_hs.series.port",
    "vllm_hs.series.lint",
    "vllm_hs.series.upstream_tests",
)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-hs",
        description="Hidden-state output channel for vLLM: build a patched vLLM, "
        "check an installation, extract training data, maintain the patch series.",
        epilog="Run 'vllm-hs <command> --help' for the flags of one command. "
        "Documentation: README.md and docs/ of the vllm-hs repository "
        "(docs/tool.md: every command).",
    )
    parser.add_argument(
        "-V", "--version", action="version", version=f"vllm-hs {__version__}"
    )
    subparsers = parser.add_subparsers(
        title="commands", dest="command", metavar="<command>", required=True
    )
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_unknown_options", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown_options = unknown
    configure_logging()
    try:
        return int(args.handler(args) or EXIT_OK)
    except UsageError as error:
        print(f"vllm-hs {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except VllmHsError as error:
        print(f"vllm-hs {args.command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
