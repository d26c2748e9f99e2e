"""Rounds: every side of a comparison runs once per round, in an order that
rotates from round to round (A B, then B A, ...), so that slow drifts of a
noisy machine, and running first or last, hit every side alike."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def rotation(names: Sequence[str], round_index: int) -> list[str]:
    """The order of round `round_index`: `names` rotated by that many places."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


def run_rounds(
    rounds: int, sides: Mapping[str, Callable[[], T]], *, rotate: bool = True
) -> Iterator[dict[str, T]]:
    """Run every side once per round (in `rotation` order, or as given when
    not `rotate`); yield each round's measurements by side, in the order run,
    as the round ends."""
    for r in range(rounds):
        order = rotation(list(sides), r) if rotate else list(sides)
        yield {name: sides[name]() for name in order}


def alternate(
    rounds: int,
    side_a: Callable[[], dict[str, Any]],
    side_b: Callable[[], dict[str, Any]],
    ratio: Callable[[dict[str, Any], dict[str, Any]], float],
) -> list[dict[str, Any]]:
    """Run A then B, `rounds` times (B first on odd rounds); return every
    round with its ratio."""
    results = []
    for r, got in enumerate(run_rounds(rounds, {"A": side_a, "B": side_b})):
        a, b = got["A"], got["B"]
        results.append({"round": r, "A": a, "B": b, "ratio": ratio(a, b)})
        print(f"  round {r}: ratio {results[-1]['ratio']:.4f}", flush=True)
    return results
