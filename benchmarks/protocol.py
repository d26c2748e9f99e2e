"""The suite protocol: what every benchmark suite declares.

A suite is a name, the sides it compares (patched against unpatched, states
on against off, one encoding against another), a settings dataclass and a
`measure` function from those settings to its results (one figure each; a
suite may give several from the same runs). The runner
(`benchmarks.runner`) does the rest: the command line, machine facts and
versions, the result files and the report.

A settings field is a command-line option of `python -m benchmarks run`
when its metadata has a help text (`option`): `--field-name`, parsed as its
default's type; a bool field's option flips its default (`--quick`, or
`--compile` for `eager`). Every option defaults to None on the command line,
so that an option left out keeps each suite's own default; two suites that
share an option name share its meaning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from benchmarks.result import Result


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A settings field that is a command-line option (see the module's text).
    Mutable defaults (lists) are copied per instance."""
    metadata = {"help": help, "flag": flag, "parse": parse}
    if isinstance(default, list):
        return dataclasses.field(
            default_factory=lambda: list(default), metadata=metadata
        )
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Option:
    """One command-line option, as a settings field declares it."""

    name: str
    flag: str
    help: str
    default: Any
    parse: Callable[[str], Any] | None
    """None for a bool: the option sets the opposite of `default`."""


def options_of(settings: type) -> list[Option]:
    """The command-line options of a settings dataclass."""
    found = []
    for f in dataclasses.fields(settings):
        if "help" not in f.metadata:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{settings.__name__}.{f.name}: an option needs a default")
        parse = f.metadata["parse"]
        if parse is None and not isinstance(default, bool):
            parse = str if default is None else type(default)
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        found.append(Option(f.name, flag, f.metadata["help"], default, parse))
    return found


@dataclass(frozen=True)
class Suite:
    """A benchmark suite: see the module's text."""

    name: str
    about: str
    """One line: what the suite's figures compare."""
    sides: tuple[str, ...]
    settings: type
    """A dataclass; its `option` fields are the suite's command-line options."""
    measure: Callable[[Any], list[Result]]
    """Settings -> results; an empty list when the suite cannot run here (it
    says why)."""

    def options(self) -> list[Option]:
        return options_of(self.settings)

    def resolve(self, given: dict[str, Any]) -> Any:
        """The suite's settings: its defaults, overridden by the options given
        (not None) that are its own."""
        own = {o.name for o in self.options()}
        return self.settings(
            **{k: v for k, v in given.items() if k in own and v is not None}
        )


def shared_options(suites: Iterable[Suite]) -> dict[str, tuple[Option, list[str]]]:
    """Every option of the suites, once, with the suites that take it. Two
    suites declaring one name must parse it alike (and a bool must flip the
    same default)."""
    merged: dict[str, tuple[Option, list[str]]] = {}
    for suite in suites:
        for o in suite.options():
            if o.name not in merged:
                merged[o.name] = (o, [suite.name])
                continue
            first, users = merged[o.name]
            same_bool = isinstance(o.default, bool) == isinstance(first.default, bool)
            if (
                first.flag != o.flag
                or not same_bool
                or (isinstance(o.default, bool) and o.default != first.default)
            ):
                raise TypeError(f"option {o.name}: {users[0]} and {suite.name} differ")
            users.append(suite.name)
    return merged
