"""The `vllm-hs` command line: parser assembly, shared options, exit codes, logging.

One subcommand per module, vLLM style. Adding a subcommand: write a module with

    def add_parser(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("name", help="...", description="...")
        parser.add_argument(...)            # a help= for every flag
        parser.set_defaults(handler=run)    # run(args: argparse.Namespace) -> int

and list it in SUBCOMMAND_MODULES. `run` returns the exit status and raises
VllmHsError for failures the user should read as one message. Every listed module
is imported to build `--help`, so import heavy dependencies (vllm, torch) inside
`run`, not at module level.

Messages go through `logging` (logger ``vllm_hs.<module>``, shown on stderr as
``vllm-hs: <message>``); stdout carries only a command's result (a path, a report,
JSON).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_hs import __version__
from vllm_hs.errors import VllmHsError

EXIT_OK = 0
EXIT_ERROR = 1  # a VllmHsError: one message on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

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


class HelpFormatter(argparse.HelpFormatter):
    """Wraps description and epilog paragraphs; keeps indented lines (examples)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            lines = paragraph.splitlines()
            if any(line.startswith(" ") for line in lines[1:]):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(
                    textwrap.fill(
                        " ".join(paragraph.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(paragraphs)


class ArgumentParser(argparse.ArgumentParser):
    """The parser class of vllm-hs and (through add_subparsers) its subcommands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="vllm-hs",
        description="Hidden-state output channel for vLLM: apply the patch series, "
        "build patched wheels, check an installation.",
        epilog="Run 'vllm-hs <command> --help' for the flags of one command.",
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


def add_series_dir_option(parser: argparse.ArgumentParser) -> None:
    """`--series-dir DIR`, shared by every command that reads a patch series."""
    parser.add_argument(
        "--series-dir",
        type=lambda value: Path(value).resolve(),  # commands change directory
        metavar="DIR",
        default=None,
        help="folder holding one v<version>/ series folder per vLLM version "
        "(default: the series shipped with this vllm-hs)",
    )


def configure_logging(level: int = logging.INFO) -> None:
    """Show vllm_hs's log records on stderr as ``vllm-hs: <message>`` (once)."""
    logger = logging.getLogger("vllm_hs")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("vllm-hs: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        return int(args.handler(args) or EXIT_OK)
    except VllmHsError as error:
        print(f"vllm-hs {args.command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
