"""Read chat conversations for `vllm-hs extract`: JSONL files (OpenAI ``messages``
or ShareGPT ``conversations``) and saved HF `datasets` directories.

Every conversation comes back as a list of ``{"role", "content"}`` dicts with role
``system``, ``user`` or ``assistant`` and string content. Accepted rows:

* OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}``;
  ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts
  (joined without separator). Other part types (images, audio) are rejected.
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}]}``
  (``user``/``assistant`` are accepted as ``from`` too).

Other keys of a row are ignored. A row that is not one of these forms is an error
naming the file and line (JSONL) or row (datasets), never skipped silently: the
caller stops before it starts an engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "ROLES",
    "Conversation",
    "ConversationError",
    "load_conversations",
    "normalize_conversation",
    "shipped_conversations_path",
]

Conversation = list[dict[str, str]]

ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}


class ConversationError(ValueError):
    """An input row is not a conversation in a supported form."""


def shipped_conversations_path() -> Path:
    """The conversation set shipped in the package (`vllm_hs/data`)."""
    return Path(__file__).resolve().parent / "data" / "conversations.jsonl"


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part)
                raise ConversationError(
                    f"{where}: content part {kind!r} is not supported "
                    "(only text parts: {'type': 'text', 'text': ...})"
                )
        return "".join(parts)
    raise ConversationError(
        f"{where}: content must be a string or a list of text parts, "
        f"got {type(value).__name__}"
    )


def normalize_conversation(row: Any, where: str) -> Conversation:
    """One row (OpenAI or ShareGPT form) as ``[{"role", "content"}]``; raises
    ConversationError naming ``where``."""
    if not isinstance(row, dict):
        raise ConversationError(
            f"{where}: expected a JSON object with 'messages' or 'conversations', "
            f"got {type(row).__name__}"
        )
    if row.get("messages") is not None:
        turns, role_key, text_key, roles = row["messages"], "role", "content", None
    elif row.get("conversations") is not None:
        turns, role_key, text_key = row["conversations"], "from", "value"
        roles = _SHAREGPT_ROLES
    else:
        raise ConversationError(
            f"{where}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) key; "
            f"keys: {sorted(row)}"
        )
    if not isinstance(turns, list) or not turns:
        raise ConversationError(f"{where}: '{role_key}' turns must be a non-empty list")
    out: Conversation = []
    for t, turn in enumerate(turns):
        at = f"{where}: turn {t}"
        if not isinstance(turn, dict) or role_key not in turn:
            raise ConversationError(f"{at}: expected an object with {role_key!r}")
        role = turn[role_key]
        if roles is not None:
            if role not in roles:
                raise ConversationError(
                    f"{at}: unknown 'from' {role!r}; expected one of {sorted(roles)}"
                )
            role = roles[role]
        elif role not in ROLES:
            raise ConversationError(
                f"{at}: unknown role {role!r}; expected one of {list(ROLES)}"
            )
        if text_key not in turn:
            raise ConversationError(f"{at}: no {text_key!r}")
        out.append({"role": role, "content": _content(turn[text_key], at)})
    return out


def _read_jsonl(path: Path) -> Iterator[Conversation]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConversationError(f"{where}: not UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConversationError(f"{where}: invalid JSON ({e})") from None
            yield normalize_conversation(row, where)


def _read_datasets_dir(path: Path) -> Iterator[Conversation]:
    try:
        from datasets import Dataset, DatasetDict, load_from_disk
    except ImportError as e:
        raise ConversationError(
            f"{path} is a directory: reading a saved HF datasets directory needs "
            f"the 'datasets' package ({e})"
        ) from None
    try:
        data = load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types
        raise ConversationError(
            f"{path}: not a saved HF datasets directory ({type(e).__name__}: {e})"
        ) from None
    if isinstance(data, DatasetDict):
        raise ConversationError(
            f"{path} holds several splits {sorted(data)}; pass one split's "
            f"directory, e.g. {path / sorted(data)[0]}"
        )
    assert isinstance(data, Dataset)
    columns = set(data.column_names)
    if not columns & {"messages", "conversations"}:
        raise ConversationError(
            f"{path}: no 'messages' or 'conversations' column; columns: "
            f"{sorted(columns)}"
        )
    data = data.with_format(None)
    for index in range(len(data)):
        yield normalize_conversation(data[index], f"{path}: row {index}")


def load_conversations(path: Path | str) -> tuple[list[Conversation], str]:
    """All conversations of a JSONL file or a saved datasets directory, in order,
    and a SHA-256 of their normalized form (identifies the input for --resume).
    Raises ConversationError on the first malformed row."""
    source = Path(path)
    if not source.exists():
        raise ConversationError(f"{source}: no such file or directory")
    rows: Iterable[Conversation] = (
        _read_datasets_dir(source) if source.is_dir() else _read_jsonl(source)
    )
    conversations = list(rows)
    digest = hashlib.sha256()
    for conversation in conversations:
        digest.update(json.dumps(conversation, sort_keys=True).encode())
        digest.update(b"\n")
    return conversations, digest.hexdigest()
