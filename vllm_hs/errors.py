"""The one exception type every vllm-hs command reports as a single message."""

from __future__ import annotations

import importlib
from types import ModuleType


class VllmHsError(Exception):
    """A failure to report to the user as one clear message (no traceback).

    `vllm-hs` prints it as ``vllm-hs <command>: error: <message>`` and exits with
    `cli.EXIT_ERROR`.
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
