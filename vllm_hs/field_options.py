"""Command-line options declared once, on the fields of a settings dataclass.

A field made with `option` is a command-line option: its flag (default
``--field-name``), help, metavar, how its text is parsed, the check its value
must pass, and its default (the field's, unless the command line has its own).
`add_options` declares a dataclass's options on an argparse parser, in field
order (the options of a sub-settings class, `Flag.nested`, right after the
field holding it); `given_options` reads them back from the parsed namespace.

argparse only finds the options and their text. `given_options` parses each
text (a str value: given, or a command-line default written as it would be
given) and checks the value, so that a value that cannot be used is one line
naming the flag (`UsageError`, exit status 2) before anything starts. A bool
field's option flips its default (``--resume``; ``--no-validate`` for a field
that defaults to True); a `Flag.switch` is such an option on a field of another
type (``--regenerate`` turns on the `RegenerateSettings`), whose value the
command builds.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hs.errors import UsageError

__all__ = [
    "Flag",
    "Option",
    "add_options",
    "given_options",
    "integer",
    "number",
    "option",
    "options_of",
]

_FLAG = "vllm_hs.flag"
_MISSING: Any = dataclasses.MISSING
_NO_COMMAND_LINE_DEFAULT: Any = object()


@dataclass(frozen=True)
class Flag:
    """How a field is given on the command line (see the module's text)."""

    help: str
    flag: str | None = None
    """None: ``--field-name``."""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    """Text -> value; raises ValueError with the reason (None: the text)."""
    check: Callable[[Any], str | None] | None = None
    """Value (not None) -> what is wrong with it, or None."""
    choices: tuple[str, ...] | None = None
    command_line_default: Any = _NO_COMMAND_LINE_DEFAULT
    """The default on the command line when it is not the field's (or the field
    has none)."""
    const: str | None = None
    """The value of the flag given without one (its value is optional)."""
    switch: bool = False
    """A flag without a value on a field that is not a bool (default: off)."""
    nested: type | None = None
    """A settings dataclass whose options follow this one on the command line."""


def option(
    help: str,
    *,
    default: Any = _MISSING,
    metadata: Mapping[str, Any] | None = None,
    **flag: Any,
) -> Any:
    """A settings field that is a command-line option; ``flag``: the other
    fields of `Flag`, ``metadata``: the field's other metadata. Without
    ``default`` the field is required (the command line then needs
    ``command_line_default``)."""
    return dataclasses.field(
        default=default, metadata={**(metadata or {}), _FLAG: Flag(help, **flag)}
    )


@dataclass(frozen=True)
class Option:
    """One command-line option: a field's name, its flag, its declaration and
    its default on the command line."""

    name: str
    flag: str
    spec: Flag
    default: Any


def options_of(settings: type, *, nested: bool = True) -> list[Option]:
    """The options of a settings dataclass, in field order; with ``nested``,
    each `Flag.nested` class's right after the field that holds it."""
    found = []
    for field in dataclasses.fields(settings):
        spec = field.metadata.get(_FLAG)
        if spec is None:
            continue
        if spec.switch:
            default = False
        elif spec.command_line_default is not _NO_COMMAND_LINE_DEFAULT:
            default = spec.command_line_default
        elif field.default is not _MISSING:
            default = field.default
        else:
            raise TypeError(f"{settings.__name__}.{field.name}: no default")
        flag = spec.flag or "--" + field.name.replace("_", "-")
        found.append(Option(field.name, flag, spec, default))
        if nested and spec.nested is not None:
            found += options_of(spec.nested)
    return found


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Declare ``options`` on ``parser`` (namespace names: the field names)."""
    for o in options:
        spec = o.spec
        kwargs: dict[str, Any] = {"dest": o.name, "default": o.default}
        if isinstance(o.default, bool):
            kwargs["action"] = "store_false" if o.default else "store_true"
        else:
            kwargs["metavar"] = spec.metavar
            if spec.choices is not None:
                kwargs["choices"] = spec.choices
            if spec.const is not None:
                kwargs.update(nargs="?", const=spec.const)
        parser.add_argument(o.flag, help=spec.help, **kwargs)


def given_options(
    args: argparse.Namespace, options: Iterable[Option]
) -> dict[str, Any]:
    """Field name -> value of each option, parsed and checked; raises
    `UsageError` naming the flag of the first value that cannot be used."""
    values = {}
    for o in options:
        value = getattr(args, o.name)
        text = value
        if isinstance(value, str) and o.spec.parse is not None:
            try:
                value = o.spec.parse(value)
            except ValueError as e:
                raise UsageError(f"{o.flag} {text}: {e}") from None
        if value is not None and o.spec.check is not None:
            problem = o.spec.check(value)
            if problem is not None:
                raise UsageError(f"{o.flag} {text}: {problem}")
        values[o.name] = value
    return values


def integer(text: str) -> int:
    """An option's text as an int."""
    try:
        return int(text)
    except ValueError:
        raise ValueError("not an integer") from None


def number(text: str) -> float:
    """An option's text as a float."""
    try:
        return float(text)
    except ValueError:
        raise ValueError("not a number") from None
