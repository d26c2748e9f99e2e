"""The one exception type every vllm-hs command reports as a single message."""

from __future__ import annotations


class VllmHsError(Exception):
    """A failure to report to the user as one clear message (no traceback).

    `vllm-hs` prints it as ``vllm-hs <command>: error: <message>`` and exits with
    `cli.EXIT_ERROR`.
    """
