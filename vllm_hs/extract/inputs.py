"""What `vllm-hs extract` reads and how it becomes samples: chat conversations,
their token ids and loss masks from the chat template, and the plan (which input
conversation becomes which dataset row).

**Conversations.** JSONL files (OpenAI ``messages`` or ShareGPT
``conversations``) and saved HF `datasets` directories. Every conversation comes
back as a list of ``{"role", "content"}`` dicts with role ``system``, ``user`` or
``assistant``; content is a string, or, for a turn with images, a list of text
parts and image parts (`vllm_hs.extract.images`). Accepted rows:

* OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}]}``;
  ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts
  (joined without separator when all are text) and image parts
  (`vllm_hs.extract.images`: each checked to be a readable image here, its
  bytes part of the input's SHA-256). Other part types (audio) are rejected.
* ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": ...}]}``
  (``user``/``assistant`` are accepted as ``from`` too).

Other keys of a row are ignored. A row that is not one of these forms is an error
naming the file and line (JSONL) or row (datasets), never skipped silently: the
caller stops before it starts an engine.

**Loss masks.** Token ids and an assistant-only loss mask come from the
tokenizer's chat template, never from searching the text, in one of two ways:

* *Generation markers.* When the template wraps assistant output in
  ``{% generation %}...{% endgeneration %}``, the mask is transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``: 1 on exactly the
  tokens rendered inside the markers (for ChatML-style templates: the assistant
  content and its end-of-turn token, not the role header and not the newline
  after the end-of-turn token).
* *Prefix renders* (templates without markers). For each assistant message
  ``i``, render ``messages[:i]`` with the generation prompt and
  ``messages[:i+1]`` without it; the tokens the second render adds after the
  first are the assistant turn (mask 1). The whole conversation's render must
  start with each such render (the template is prefix-stable), else the sample
  is rejected with `LossMaskError`. This marks everything the template emits
  for the turn after the generation prompt, which may include glue after the
  end-of-turn token (ChatML: the trailing newline) - the same boundary
  speculators >= 0.5 uses.

**Plan.** `plan_samples` renders this shard's conversations and numbers the
samples it keeps (dataset rows, in input order); the rest come back as `Skip`
records (stage ``plan``) for skipped.jsonl.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_hs.extract.images import (
    ImageError,
    image_part,
    image_sha256,
    image_urls,
    template_messages,
)
from vllm_hs.extract.records import Skip

__all__ = [
    "ROLES",
    "Conversation",
    "ConversationError",
    "LossMaskError",
    "Sample",
    "has_generation_markers",
    "load_conversations",
    "normalize_conversation",
    "plan_samples",
    "regenerate_slots",
    "render_with_mask",
    "shipped_conversations_path",
]

Conversation = list[dict[str, Any]]
"""``[{"role", "content"}]``: content a string, or a list of text and image
parts (a turn with images)."""

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
    return Path(__file__).resolve().parents[1] / "data" / "conversations.jsonl"


def _content(value: Any, where: str, base_dir: Path) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[dict[str, Any]] = []
        for part in value:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append({"type": "text", "text": part["text"]})
                continue
            image = None
            if isinstance(part, dict):
                try:
                    image = image_part(part, base_dir)
                except ImageError as e:
                    raise ConversationError(f"{where}: {e}") from None
            if image is None:
                kind = part.get("type") if isinstance(part, dict) else type(part)
                raise ConversationError(
                    f"{where}: content part {kind!r} is not supported "
                    "(text parts: {'type': 'text', 'text': ...}; image parts: "
                    "{'type': 'image_url', 'image_url': {'url': ...}} or "
                    "{'type': 'image', 'path'|'url': ...})"
                )
            parts.append(image)
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise ConversationError(
        f"{where}: content must be a string or a list of text and image parts, "
        f"got {type(value).__name__}"
    )


def normalize_conversation(
    row: Any, where: str, base_dir: Path | None = None
) -> Conversation:
    """One row (OpenAI or ShareGPT form) as ``[{"role", "content"}]``; raises
    ConversationError naming ``where``. ``base_dir``: where relative image
    paths start (default: the working directory)."""
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
        content = _content(turn[text_key], at, base_dir or Path.cwd())
        out.append({"role": role, "content": content})
    return out


def _checked(conversation: Conversation, where: str) -> tuple[Conversation, list[str]]:
    """A conversation and the SHA-256 of each of its images (each read and
    checked to decode now, before any engine starts)."""
    try:
        return conversation, [image_sha256(url) for url in image_urls(conversation)]
    except ImageError as e:
        raise ConversationError(f"{where}: {e}") from None


def _read_jsonl(path: Path) -> Iterator[tuple[Conversation, list[str]]]:
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
            yield _checked(normalize_conversation(row, where, path.parent), where)


def _read_datasets_dir(path: Path) -> Iterator[tuple[Conversation, list[str]]]:
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
        where = f"{path}: row {index}"
        row = normalize_conversation(data[index], where, path.parent)
        yield _checked(row, where)


def load_conversations(path: Path | str) -> tuple[list[Conversation], str]:
    """All conversations of a JSONL file or a saved datasets directory, in order,
    and a SHA-256 of their normalized form and their images' bytes (identifies
    the input for --resume). Relative image paths start in the directory holding
    ``path``. Raises ConversationError on the first malformed row or missing or
    unreadable image."""
    source = Path(path)
    if not source.exists():
        raise ConversationError(f"{source}: no such file or directory")
    rows: Iterable[tuple[Conversation, list[str]]] = (
        _read_datasets_dir(source) if source.is_dir() else _read_jsonl(source)
    )
    conversations = []
    digest = hashlib.sha256()
    for conversation, images in rows:
        conversations.append(conversation)
        digest.update(json.dumps(conversation, sort_keys=True).encode())
        for image in images:  # text conversations: as before images
            digest.update(f" image {image}".encode())
        digest.update(b"\n")
    return conversations, digest.hexdigest()


# ----------------------------------------------------------------------------
# Token ids and loss masks
# ----------------------------------------------------------------------------


_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class LossMaskError(ValueError):
    """The template cannot render this conversation with a trustworthy mask."""


def has_generation_markers(chat_template: str | None) -> bool:
    """Whether the template marks assistant output with ``{% generation %}``."""
    return bool(chat_template) and bool(_GENERATION_RE.search(chat_template or ""))


def _render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    *,
    assistant_mask: bool = False,
) -> tuple[list[int], list[int] | None]:
    """Token ids of the rendered conversation, and with `assistant_mask` the
    template's ``{% generation %}`` mask (else None)."""
    enc = tokenizer.apply_chat_template(
        template_messages(messages),
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        return_dict=True,
        return_assistant_tokens_mask=assistant_mask,
    )
    ids = [int(t) for t in enc["input_ids"]]
    mask = [int(m) for m in enc["assistant_masks"]] if assistant_mask else None
    return ids, mask


def render_with_mask(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation rendered by the chat template.

    ``loss_mask[t]`` is 1 where token ``t`` belongs to an assistant turn (module
    docstring). ``chat_template`` overrides the tokenizer's. Templates with
    ``{% generation %}`` markers take the marker path, others the prefix renders.
    Raises `LossMaskError` when the template fails or is not prefix-stable.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise LossMaskError(
            "the tokenizer has no chat template; pass one with --chat-template"
        )
    try:
        if has_generation_markers(template):
            ids, marked = _render(
                tokenizer,
                messages,
                add_generation_prompt,
                template,
                assistant_mask=True,
            )
            mask = marked or []
        else:
            ids, mask = _prefix_mask(
                tokenizer, messages, add_generation_prompt, template
            )
    except LossMaskError:
        raise
    except Exception as e:  # noqa: BLE001 - templates raise anything (TemplateError)
        raise LossMaskError(
            f"the chat template failed on this conversation ({type(e).__name__}: {e})"
        ) from e
    if len(ids) != len(mask):
        raise LossMaskError(f"{len(ids)} tokens but {len(mask)} mask entries")
    return ids, mask


def _prefix_mask(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    template: str,
) -> tuple[list[int], list[int]]:
    full, _ = _render(tokenizer, messages, add_generation_prompt, template)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = _render(tokenizer, messages[:i], True, template)
        through, _ = _render(tokenizer, messages[: i + 1], False, template)
        if through[: len(before)] != before or full[: len(through)] != through:
            raise LossMaskError(
                f"the chat template is not prefix-stable at assistant message {i}: "
                "rendering the conversation up to it does not extend the render "
                "before it (or the full render does not start with it), so the "
                "assistant tokens cannot be located; use a template with "
                "{% generation %} markers (--chat-template)"
            )
        for t in range(len(before), len(through)):
            mask[t] = 1
    return full, mask


# ----------------------------------------------------------------------------
# Plan: which conversations become which rows
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    """One planned sample: input conversation ``index`` becomes dataset ``row``."""

    index: int
    row: int
    messages: Conversation
    input_ids: array
    """Token ids (``array('i')``, 4 bytes a token: plans of millions of samples
    stay small). Default mode: the whole rendered conversation. --regenerate:
    the first generation prompt (the final ids are known after generation)."""
    loss_mask: bytes
    """0/1 per token."""
    slots: list[int] = dataclasses.field(default_factory=list)
    """--regenerate: message positions to (re)write, in order; position
    len(messages) = answer a trailing user message."""


def regenerate_slots(messages: Conversation) -> list[int]:
    """Positions --regenerate writes: every assistant message, and a reply after a
    trailing user message."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    return slots


def plan_samples(
    conversations: Sequence[Conversation],
    tokenizer: Any,
    *,
    max_length: int,
    regenerate: bool = False,
    num_shards: int = 1,
    shard_index: int = 0,
    chat_template: str | None = None,
) -> tuple[list[Sample], list[Skip]]:
    """Render this shard's conversations (input index ``n`` with
    ``n % num_shards == shard_index``) and assign dataset rows in input order.
    Conversations longer than ``max_length`` tokens, without assistant tokens, or
    that the template cannot mask are skipped (returned as `Skip`)."""
    samples: list[Sample] = []
    skipped: list[Skip] = []
    for index in range(shard_index, len(conversations), num_shards):
        messages = conversations[index]
        try:
            if regenerate:
                slots = regenerate_slots(messages)
                if not slots:
                    skipped.append(
                        Skip(
                            index,
                            "nothing to regenerate: no assistant message "
                            "and no trailing user message",
                        )
                    )
                    continue
                ids, mask = render_with_mask(
                    tokenizer,
                    messages[: slots[0]],
                    add_generation_prompt=True,
                    chat_template=chat_template,
                )
                if len(ids) >= max_length:
                    skipped.append(
                        Skip(
                            index,
                            f"generation prompt of {len(ids)} tokens leaves "
                            f"no room to generate within --max-length {max_length}",
                        )
                    )
                    continue
            else:
                slots = []
                ids, mask = render_with_mask(
                    tokenizer, messages, chat_template=chat_template
                )
                if len(ids) > max_length:
                    skipped.append(
                        Skip(
                            index,
                            f"{len(ids)} tokens > --max-length {max_length} "
                            "(not truncated)",
                        )
                    )
                    continue
                if not any(mask):
                    skipped.append(Skip(index, "no assistant tokens (loss mask all 0)"))
                    continue
        except LossMaskError as e:
            skipped.append(Skip(index, str(e)))
            continue
        samples.append(
            Sample(index, len(samples), messages, array("i", ids), bytes(mask), slots)
        )
    return samples, skipped
