"""Checks of the paths and names given on the command line, made before a
command starts its work: each returns what is wrong with the value (a short
reason, which the caller prefixes with the flag and the value), or None.

A flag declared with `vllm_hs.field_options.option` names them as its
``check`` (or ``parse``, for a file read whole); other commands call them and
raise `vllm_hs.errors.UsageError` themselves (`require`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from vllm_hs.errors import UsageError

__all__ = [
    "MODEL_CONFIG_FILES",
    "can_be_made",
    "existing_dir",
    "existing_file",
    "existing_path",
    "model_problem",
    "new_or_writable_dir",
    "new_path",
    "positive",
    "read_text_file",
    "require",
    "writable_file",
]

#: A model directory holds one of these (HF's config, or a Mistral-format model's).
MODEL_CONFIG_FILES = ("config.json", "params.json")

_Value = TypeVar("_Value")


def require(
    flag: str, value: _Value | None, check: Callable[[_Value], str | None]
) -> None:
    """Raise `UsageError` ("FLAG VALUE: reason") when ``check`` finds a problem
    with ``value`` (None: not given, nothing to check)."""
    if value is None:
        return
    problem = check(value)
    if problem is not None:
        raise UsageError(f"{flag} {value}: {problem}")


def existing_path(path: Path) -> str | None:
    """A file or a directory that can be read."""
    if not path.exists():
        return "no such file or directory"
    if not os.access(path, os.R_OK):
        return "not readable"
    return None


def existing_file(path: Path) -> str | None:
    """A file that can be read."""
    if path.is_dir():
        return "a directory, not a file"
    return existing_path(path)


def existing_dir(path: Path) -> str | None:
    """A directory that can be read."""
    if path.exists() and not path.is_dir():
        return "not a directory"
    return existing_path(path)


def new_or_writable_dir(path: Path) -> str | None:
    """A directory to write into: one that exists and can be written, or one
    that can be made (its nearest existing parent is a writable directory)."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "not writable"
        return None
    return can_be_made(path)


def new_path(path: Path) -> str | None:
    """A path that does not exist yet and can be made: its nearest existing
    parent is a writable directory."""
    if path.exists():
        return "already exists"
    return can_be_made(path)


def writable_file(path: Path) -> str | None:
    """A file to write: one that can be written, or one that can be made."""
    if path.is_dir():
        return "a directory, not a file"
    if path.exists():
        return None if os.access(path, os.W_OK) else "not writable"
    return can_be_made(path)


def positive(value: int) -> str | None:
    """A number above 0."""
    return None if value > 0 else "must be at least 1"


def can_be_made(path: Path) -> str | None:
    """A path that exists, or whose nearest existing parent is a writable
    directory (whether it may exist already is the command's to say)."""
    if path.exists():
        return None
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be made: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: {parent} is not writable"
    return None


def read_text_file(text: str) -> str:
    """The content of the file named ``text`` (a `field_options.Flag.parse`):
    ValueError with the reason when it cannot be read."""
    path = Path(text)
    problem = existing_file(path)
    if problem is not None:
        raise ValueError(problem)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError("not a UTF-8 text file") from None
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None


def model_problem(model: str) -> str | None:
    """vLLM's --model: a model directory (one of `MODEL_CONFIG_FILES`) or a
    GGUF file, else a Hugging Face model id; with HF_HUB_OFFLINE set, one in
    the local Hugging Face cache. An id is not looked up online (vLLM does)."""
    path = Path(model).expanduser()
    if path.is_file():
        return None if path.suffix == ".gguf" else "a file, not a model directory"
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            return "not readable"
        if not any((path / name).is_file() for name in MODEL_CONFIG_FILES):
            return f"holds no model (no {' or '.join(MODEL_CONFIG_FILES)})"
        return None
    try:
        from huggingface_hub import constants, try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # no vLLM either: the command says so next
        return None
    try:
        validate_repo_id(model)
    except HFValidationError:
        return "no such directory (nor a Hugging Face model id)"
    if not constants.HF_HUB_OFFLINE:
        return None
    if not isinstance(try_to_load_from_cache(model, MODEL_CONFIG_FILES[0]), str):
        return (
            "no such directory, and not a model in the Hugging Face cache "
            "(HF_HUB_OFFLINE is set)"
        )
    return None
