"""Responses and streams of the server read back: token ids, finish reasons and
decoded hidden states by choice (`Collected`), from raw JSON or openai objects."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_hs.client import RefFetcher, ResponseHiddenStates, sse_events


def get(obj: Any, name: str) -> Any:
    """A field of a raw JSON dict or of an openai client object (extra fields
    live in `model_extra`)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(name)
    value = getattr(obj, name, None)
    if value is None:
        value = (getattr(obj, "model_extra", None) or {}).get(name)
    return value


@dataclass
class Collected:
    """Tokens and decoded states of one response or stream, by choice index.

    `prompt_ids` holds the prompt token ids by choice index for completions
    and under 0 for chat. `states` comes from `vllm_hs.client`. For streams,
    `rows_vs_tokens` records after every chunk carrying token ids
    (index, output rows so far, tokens so far)."""

    chat: bool
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    states: ResponseHiddenStates = field(default_factory=ResponseHiddenStates)
    payloads: list[tuple[str, int, Any]] = field(default_factory=list)
    rows_vs_tokens: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_chunk: dict[int, int] = field(default_factory=dict)
    """stream: choice index (chat: 0) -> ordinal of the token-carrying chunk
    (of that choice; chat: of any choice) that brought the prompt states."""
    token_chunks: dict[int, int] = field(default_factory=dict)
    num_chunks: int = 0


def _record_payloads(out: Collected, obj: Any) -> None:
    top = get(obj, "prompt_hidden_states")
    if top is not None:
        out.payloads.append(("prompt", 0, top))
    for choice in get(obj, "choices") or ():
        index = int(get(choice, "index"))
        for kind, key in (
            ("prompt", "prompt_hidden_states"),
            ("output", "hidden_states"),
        ):
            payload = get(choice, key)
            if payload is not None:
                out.payloads.append((kind, index, payload))


def collect_response(
    response: Any, chat: bool, fetch: RefFetcher | None = None
) -> Collected:
    """A non-streamed completion / chat completion (dict or openai object);
    `fetch` reads `"encoding": "ref"` payloads."""
    out = Collected(chat=chat)
    out.states.fetch = fetch
    if chat:
        prompt = get(response, "prompt_token_ids")
        if prompt is not None:
            out.prompt_ids[0] = list(prompt)
    for choice in get(response, "choices") or ():
        index = int(get(choice, "index"))
        if not chat:
            prompt = get(choice, "prompt_token_ids")
            if prompt is not None:
                out.prompt_ids[index] = list(prompt)
        out.token_ids[index] = list(get(choice, "token_ids") or [])
        out.finish[index] = get(choice, "finish_reason")
    _record_payloads(out, response)
    out.states.add(response)
    return out


def collect_stream(
    chunks: Iterable[Any], chat: bool, fetch: RefFetcher | None = None
) -> Collected:
    """A stream of chunks (dicts from `sse_events`, or openai chunk objects)."""
    out = Collected(chat=chat)
    out.states.fetch = fetch
    for chunk in chunks:
        out.num_chunks += 1
        if chat:
            prompt = get(chunk, "prompt_token_ids")
            if prompt is not None:
                # Upstream vLLM repeats them on each choice's role chunk (n > 1).
                previous = out.prompt_ids.setdefault(0, list(prompt))
                assert previous == list(prompt), "prompt_token_ids differ"
        for choice in get(chunk, "choices") or ():
            index = int(get(choice, "index"))
            if not chat:
                prompt = get(choice, "prompt_token_ids")
                if prompt is not None:
                    assert index not in out.prompt_ids, f"prompt ids twice ({index})"
                    out.prompt_ids[index] = list(prompt)
            new_tokens = list(get(choice, "token_ids") or [])
            tokens = out.token_ids.setdefault(index, [])
            tokens.extend(new_tokens)
            if new_tokens:
                out.token_chunks[index] = out.token_chunks.get(index, 0) + 1
            if get(choice, "finish_reason") is not None:
                out.finish[index] = get(choice, "finish_reason")
            if not chat and get(choice, "prompt_hidden_states") is not None:
                out.prompt_chunk.setdefault(index, out.token_chunks.get(index, 0))
        if any(get(c, "token_ids") for c in get(chunk, "choices") or ()):
            out.token_chunks[-1] = out.token_chunks.get(-1, 0) + 1  # any choice
        if chat and get(chunk, "prompt_hidden_states") is not None:
            out.prompt_chunk.setdefault(0, out.token_chunks.get(-1, 0))
        _record_payloads(out, chunk)
        out.states.add(chunk)
        for choice in get(chunk, "choices") or ():
            index = int(get(choice, "index"))
            if get(choice, "token_ids"):
                rows = out.states.output(index)
                out.rows_vs_tokens.append(
                    (
                        index,
                        0 if rows is None else rows.shape[0],
                        len(out.token_ids[index]),
                    )
                )
    return out


def sse_chunks(response: Any) -> Iterator[dict[str, Any]]:
    """Chunks of an httpx streaming response (`client.stream(...)`)."""
    return sse_events(response.iter_lines())


def ask(
    oai: Any,
    model: str,
    stream: bool,
    hidden_states: dict[str, Any] | None,
    *,
    max_tokens: int,
    prompt: Any = None,
    messages: list[dict[str, str]] | None = None,
    **kwargs: Any,
) -> Collected:
    """One completion (`prompt`) or chat completion (`messages`) through the
    `openai` client, greedy unless `kwargs` say otherwise, token ids returned and
    EOS ignored, collected (streamed or not)."""
    chat = messages is not None
    extra: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True}
    if hidden_states is not None:
        extra["hidden_states"] = hidden_states
    kwargs.setdefault("temperature", 0.0)
    common = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if chat:
        response = oai.chat.completions.create(
            messages=messages, extra_body=extra, **common, **kwargs
        )
    else:
        response = oai.completions.create(
            prompt=prompt, extra_body=extra, **common, **kwargs
        )
    collect = collect_stream if stream else collect_response
    return collect(response, chat=chat)
