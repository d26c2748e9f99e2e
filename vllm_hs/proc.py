"""The one way vllm-hs runs another program (pip, git, wheel, pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_hs.errors import VllmHsError


class CommandError(VllmHsError):
    """A program exited non-zero; `output` holds what it printed (stdout+stderr)."""

    def __init__(self, what: str, returncode: int, output: str) -> None:
        super().__init__(f"{what} failed (exit {returncode}):\n{output}")
        self.what = what
        self.returncode = returncode
        self.output = output


def run(
    command: Sequence[str | os.PathLike[str]],
    *,
    what: str | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    stream: bool = False,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run `command` and return it finished.

    Captured (default): stdout and stderr come back as text on the result, and a
    failure raises `CommandError` with both. `stream=True`: the program writes to
    our stderr (stdout is kept for a command's own result, e.g. a wheel's path).
    `what` names the program in errors (default: the command line). A missing
    program raises `VllmHsError` naming it.
    """
    argv = [str(part) for part in command]
    what = what or " ".join(argv)
    try:
        if stream:
            sys.stderr.flush()
            result = subprocess.run(
                argv, cwd=cwd, env=env, input=input, text=True,
                stdout=sys.stderr, stderr=sys.stderr,
            )  # fmt: skip
        else:
            result = subprocess.run(
                argv, cwd=cwd, env=env, input=input, text=True, capture_output=True
            )
    except FileNotFoundError:
        raise VllmHsError(f"{argv[0]} is needed for {what}; install it") from None
    if check and result.returncode != 0:
        output = (
            "(output above)"
            if stream
            else ((result.stdout or "") + (result.stderr or "")).strip()
        )
        raise CommandError(what, result.returncode, output)
    return result
