"""vLLM's engine options on `vllm-hs extract`'s command line, and the engine
options a run starts its engines with (`engine_options`).

Importing vLLM to declare its options takes seconds, and `vllm-hs --help`
imports every command module, so the extract parser (`ExtractParser`) declares
them only when a command line needs them: when it holds an option extract does
not define itself. Options after ``--`` are parsed separately by vLLM's own
parser (`_engine_overrides`), which also reads its shorthands.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from vllm_hs.command import ArgumentParser
from vllm_hs.errors import VllmHsError

__all__ = [
    "EMBEDDED_ENGINE_DEFAULTS",
    "ExtractParser",
    "add_engine_options",
    "check_own_options",
    "engine_options",
    "given_engine_options",
]

logger = logging.getLogger(__name__)

#: Engine options for the embedded tiny model (the user's options win).
EMBEDDED_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # vLLM on CPU would run the fp32 checkpoint in bf16
    "kv_cache_memory_bytes": 256 << 20,
    "enforce_eager": True,  # compiling costs more than the whole tiny job
}

#: Prefix of the namespace names of vLLM's engine options (keeps them apart from
#: extract's own).
ENGINE_DEST_PREFIX = "engine_option__"

#: Engine options extract sets from its own options.
_OWN_ENGINE_OPTIONS = {
    "model": "--model",
    "seed": "--seed",
    "hidden_states_config": "--layers",
}


class ExtractParser(ArgumentParser):
    """The extract parser: declares vLLM's engine options (`add_engine_options`)
    the first time it parses a command line holding an option it does not know,
    so that --help, --merge and input errors never import vLLM."""

    engine_options_added = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if not self.engine_options_added and self._has_unknown_option(argv):
            add_engine_options(self)
        return super().parse_known_args(argv, namespace)

    def _has_unknown_option(self, argv: Sequence[str]) -> bool:
        known = self._option_string_actions
        for arg in argv:
            if arg == "--":
                return False
            if not arg.startswith("-") or self._negative_number_matcher.match(arg):
                continue
            name = arg.split("=", 1)[0]
            if name in known or (
                self.allow_abbrev
                and name.startswith("--")
                and any(option.startswith(name) for option in known)
            ):
                continue
            return True
        return False


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Declare vLLM's engine options (``EngineArgs.add_cli_args``) on ``parser``,
    help suppressed (the epilog explains them), except those extract defines
    itself (--model, --seed). Their namespace names get `ENGINE_DEST_PREFIX`, and
    they are set only when given. Without an importable vLLM nothing is added
    (argparse then reports the option as unrecognized)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        logger.debug("vLLM's engine options are unavailable: %s", e)
        return
    source = FlexibleArgumentParser(add_help=False)
    EngineArgs.add_cli_args(source)
    own = parser._option_string_actions
    for action in source._actions:
        if any(option in own for option in action.option_strings):
            continue
        action.dest = ENGINE_DEST_PREFIX + action.dest
        action.default = argparse.SUPPRESS
        action.help = argparse.SUPPRESS
        parser._add_action(action)
    if isinstance(parser, ExtractParser):
        parser.engine_options_added = True


def given_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given directly (EngineArgs field -> value)."""
    return {
        key.removeprefix(ENGINE_DEST_PREFIX): value
        for key, value in vars(args).items()
        if key.startswith(ENGINE_DEST_PREFIX)
    }


def check_own_options(options: dict[str, Any], where: str) -> None:
    for key, option in _OWN_ENGINE_OPTIONS.items():
        if key in options:
            raise VllmHsError(f"pass {option} to vllm-hs extract, not {where}")


def _engine_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """vLLM engine options given after --, as EngineArgs fields that differ
    from vLLM's defaults."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-hs extract -- ")
    EngineArgs.add_cli_args(parser)
    defaults = vars(parser.parse_args([]))
    try:
        given = vars(parser.parse_args(list(argv)))
    except SystemExit as e:
        raise VllmHsError(f"invalid vLLM engine options after --: {list(argv)}") from e
    overrides = {k: v for k, v in given.items() if defaults.get(k) != v}
    check_own_options(overrides, "after --")
    return overrides


def engine_options(
    args: argparse.Namespace, engine_argv: Sequence[str], embedded: bool
) -> dict[str, Any]:
    """The engine options of the run: the embedded model's defaults (when it
    runs), those given directly, those after ``--`` (these win), and --seed."""
    options: dict[str, Any] = dict(EMBEDDED_ENGINE_DEFAULTS) if embedded else {}
    options.update(given_engine_options(args))
    options.update(_engine_overrides(engine_argv))
    options["seed"] = args.seed
    return options
