"""vLLM's engine options on `vllm-hs extract`'s command line, and the engine
options a run starts its engines with (`engine_options`).

extract's parser declares only its own options (importing vLLM to declare
its options takes seconds, and `vllm-hs --help` imports every command module);
the options it does not know reach the command in order
(`vllm_hs.command.accept_unknown_options`): those given directly, then ``--``
and those after it. Each part is read by vLLM's own parser (`EngineArgs`' flags,
its shorthands such as ``-O3``), so vLLM is imported only when engine options
are given, and only once extract's own options have been checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from vllm_hs.errors import UsageError, VllmHsError

__all__ = [
    "EMBEDDED_ENGINE_DEFAULTS",
    "engine_options",
    "given_engine_options",
    "split_engine_argv",
]

#: Engine options for the embedded tiny model (the user's options win).
EMBEDDED_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # vLLM on CPU would run the fp32 checkpoint in bf16
    "kv_cache_memory_bytes": 256 << 20,
    "enforce_eager": True,  # compiling costs more than the whole tiny job
}

#: Engine options extract sets from its own options.
_OWN_ENGINE_OPTIONS = {
    "model": "--model",
    "seed": "--seed",
    "hidden_states_config": "--layers",
}


class _RefusedEngineOptions(Exception):
    """vLLM's parser could not read the options (its message)."""


def split_engine_argv(unknown: Sequence[str]) -> tuple[list[str], list[str]]:
    """The options extract's parser did not know: (given directly, after ``--``)."""
    argv = list(unknown)
    if "--" not in argv:
        return argv, []
    split = argv.index("--")
    return argv[:split], argv[split + 1 :]


def _refuse_own_options(options: dict[str, Any], after: bool) -> None:
    """extract's own options given as vLLM's."""
    for key, option in _OWN_ENGINE_OPTIONS.items():
        if key in options:
            where = "after --" if after else "--" + key.replace("_", "-")
            raise VllmHsError(f"pass {option} to vllm-hs extract, not {where}")


def given_engine_options(argv: Sequence[str]) -> dict[str, Any]:
    """The vLLM engine options in ``argv``, as EngineArgs field -> value: only
    those given (a value equal to vLLM's default included). Raises
    `_RefusedEngineOptions` with vLLM's parser's message."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise _RefusedEngineOptions(message)

    parser = Parser(prog="vllm-hs extract", add_help=False)
    EngineArgs.add_cli_args(parser)
    # Every default replaced by one marker: what differs from it was given. (An
    # object, not argparse.SUPPRESS: argparse would parse a str default.)
    not_given = object()
    parser.set_defaults(**dict.fromkeys(vars(parser.parse_args([])), not_given))
    given = vars(parser.parse_args(list(argv)))
    return {k: v for k, v in given.items() if v is not not_given}


def engine_options(
    unknown: Sequence[str], *, seed: int, embedded: bool
) -> dict[str, Any]:
    """The engine options of the run: the embedded model's defaults (when it
    runs), those given directly, those after ``--`` (these win), and --seed.
    ``unknown``: what extract's parser did not know (`split_engine_argv`)."""
    direct, after = split_engine_argv(unknown)
    options: dict[str, Any] = dict(EMBEDDED_ENGINE_DEFAULTS) if embedded else {}
    if direct:
        try:
            given = given_engine_options(direct)
        except _RefusedEngineOptions as e:
            raise UsageError(str(e)) from None
        _refuse_own_options(given, after=False)
        options.update(given)
    if after:
        try:
            given = given_engine_options(after)
        except _RefusedEngineOptions as e:
            raise VllmHsError(
                f"invalid vLLM engine options after --: {after} ({e})"
            ) from None
        _refuse_own_options(given, after=True)
        options.update(given)
    options["seed"] = seed
    return options
