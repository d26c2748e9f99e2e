"""What every `vllm-hs` subcommand shares: exit codes, the parser and help
classes, shared options, logging. Subcommand modules import this, never
`vllm_hs.cli` (the dispatcher, which imports them)."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any, Protocol

EXIT_OK = 0
EXIT_ERROR = 1  # a VllmHsError: one message on stderr
EXIT_USAGE = 2  # a bad command line: argparse's errors, and a UsageError
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


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


class Subparsers(Protocol):
    """What a subcommand module's ``add_parser`` is given: the dispatcher's
    subcommands, to add its parser to."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def accept_unknown_options(parser: argparse.ArgumentParser) -> None:
    """Let the command take options its parser does not declare (`vllm-hs
    extract`: vLLM's engine options): they reach its handler, in order, as
    ``args.unknown_options`` (with a ``--`` and what follows it). Other commands
    refuse them as argparse does."""
    parser.set_defaults(takes_unknown_options=True)


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
