"""The `vllm-hs` command line: one subcommand per module, vLLM style.

Adding a subcommand: write a module with

    def add_parser(subparsers: argparse._SubParsersAction) -> None:
        parser = subparsers.add_parser("name", help="...", description="...")
        parser.add_argument(...)            # a help= for every flag
        parser.set_defaults(handler=run)    # run(args: argparse.Namespace) -> int

and list it in SUBCOMMAND_MODULES. `run` returns the exit status and raises
VllmHsError for failures the user should read as one message. Every listed module
is imported to build `--help`, so import heavy dependencies (vllm, torch) inside
`run`, not at module level. A listed module that does not exist yet is skipped.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from vllm_hs import __version__
from vllm_hs.series import VllmHsError

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "vllm_hs.apply",
    "vllm_hs.wheel",
    "vllm_hs.status",
    "vllm_hs.demo",
    "vllm_hs.extract",
    "vllm_hs.bench",
    "vllm_hs.stage",
    "vllm_hs.refresh",
    "vllm_hs.lint",
    "vllm_hs.upstream_tests",
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
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue  # not written yet
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except VllmHsError as error:
        print(f"vllm-hs {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
