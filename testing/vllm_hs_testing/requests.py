"""Requests tests send to an engine: greedy sampling, token prompts, and text
in which ngram speculation finds drafts. Seeded prompts themselves come from
`vllm_hs.models.tiny.seeded_prompt`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hs.models.tiny import seeded_prompt


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    """Greedy `SamplingParams` of exactly `max_tokens` tokens (EOS ignored)."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


def tokens_prompt(token_ids: Sequence[int]) -> Any:
    """A vLLM `TokensPrompt` of `token_ids`."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(token_ids))


def repeated_prompt(seed: int, length: int, period: int) -> list[int]:
    """A seeded phrase of `period` tokens repeated to `length`: text in which
    ngram speculation finds drafts."""
    phrase = seeded_prompt(seed, period)
    return (phrase * (length // period + 1))[:length]
