"""Token ids and an assistant-only loss mask for a conversation, from the
tokenizer's chat template.

Two ways, both derived from the template, never from searching the text:

* **Generation markers.** When the template wraps assistant output in
  ``{% generation %}...{% endgeneration %}``, the mask is transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``: 1 on exactly the
  tokens rendered inside the markers (for ChatML-style templates: the assistant
  content and its end-of-turn token, not the role header and not the newline
  after the end-of-turn token).
* **Prefix renders** (templates without markers). For each assistant message
  ``i``, render ``messages[:i]`` with the generation prompt and
  ``messages[:i+1]`` without it; the tokens the second render adds after the
  first are the assistant turn (mask 1). The whole conversation's render must
  start with each such render (the template is prefix-stable), else the sample
  is rejected with `LossMaskError`. This marks everything the template emits
  for the turn after the generation prompt, which may include glue after the
  end-of-turn token (ChatML: the trailing newline) - the same boundary
  speculators >= 0.5 uses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "LossMaskError",
    "has_generation_markers",
    "render_with_mask",
]

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


class LossMaskError(ValueError):
    """The template cannot render this conversation with a trustworthy mask."""


def has_generation_markers(chat_template: str | None) -> bool:
    """Whether the template marks assistant output with ``{% generation %}``."""
    return bool(chat_template) and bool(_GENERATION_RE.search(chat_template or ""))


def _render(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool,
    chat_template: str | None,
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        list(messages),
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        return_dict=True,
    )["input_ids"]
    return [int(t) for t in ids]


def render_with_mask(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    *,
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    use_generation_markers: bool | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation rendered by the chat template.

    ``loss_mask[t]`` is 1 where token ``t`` belongs to an assistant turn (module
    docstring). ``chat_template`` overrides the tokenizer's. With
    ``use_generation_markers=None`` the marker path is used when the template has
    markers; ``False`` forces the prefix-render path (tests compare the two).
    Raises `LossMaskError` when the template fails or is not prefix-stable.
    """
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if not template:
        raise LossMaskError(
            "the tokenizer has no chat template; pass one with --chat-template"
        )
    markers = (
        has_generation_markers(template)
        if use_generation_markers is None
        else use_generation_markers
    )
    try:
        if markers:
            enc = tokenizer.apply_chat_template(
                list(messages),
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            ids = [int(t) for t in enc["input_ids"]]
            mask = [int(m) for m in enc["assistant_masks"]]
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
    messages: Sequence[dict[str, str]],
    add_generation_prompt: bool,
    template: str,
) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages, add_generation_prompt, template)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, template)
        through = _render(tokenizer, messages[: i + 1], False, template)
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
