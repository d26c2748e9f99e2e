"""The one exception type every vllm-hs command reports as a single message."""

from __future__ import annotations

import importlib
from types import ModuleType


class VllmHsError(Exception):
    """A failure to report to the user as one clear message (no traceback).

    `vllm-hs` prints it as ``vllm-hs <command>: error: <message>`` and exits with
    `cli.EXIT_ERROR`.
    """


class UsageError(VllmHsError):
    """A value given on the command line that cannot be used (a path that does
    not exist, a number that is not one): one line naming the flag, exit status
    `command.EXIT_USAGE` (2, as argparse's own errors), before anything starts.
    """


def import_extra(module: str, purpose: str, extra: str = "extract") -> ModuleType:
    """Import `module` of vllm-hs's ``extra``, or a VllmHsError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise VllmHsError(
            f"{purpose} needs the '{module}' package ({error}); "
            f"pip install 'vllm-hs[{extra}]'"
        ) from error
