"""The hunks of a unified diff, and where a diff moved the lines of its old side
(for `vllm-hs port`'s conflict report)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", re.MULTILINE)


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    text: str


def parse_hunks(diff: str) -> list[Hunk]:
    """The hunks of a one-file unified diff, in order."""
    matches = list(_HUNK.finditer(diff))
    hunks = []
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(diff)
        old_start, old_len, new_start, new_len = (
            int(value) if value is not None else 1 for value in match.groups()
        )
        hunks.append(
            Hunk(old_start, old_len, new_start, new_len, diff[match.start() : end])
        )
    return hunks


def to_old_line(line: int, hunks: list[Hunk]) -> int:
    """Line `line` of a diff's new side, as a line of its old side (`hunks`: the
    diff, with no context)."""
    offset = 0
    for hunk in hunks:
        if hunk.new_start + hunk.new_len <= line:
            offset += hunk.new_len - hunk.old_len
        elif hunk.new_start <= line:
            return hunk.old_start
    return line - offset


def overlapping(hunks: list[Hunk], ranges: list[tuple[int, int]]) -> list[Hunk]:
    """The hunks whose old side meets one of `ranges` ([start, end) lines)."""
    return [
        hunk
        for hunk in hunks
        if any(
            hunk.old_start < end and start < hunk.old_start + max(hunk.old_len, 1)
            for start, end in ranges
        )
    ]
