"""Requests and checks of the speculative-decoding tests (ngram and EAGLE-3,
tests/engine): a table of eight requests covering the channel's options, and a
stop token among a step's accepted drafts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_hs_testing.hf_checks import Case, Expect, run_cases
from vllm_hs_testing.main_engine import MAIN_RESOLVED
from vllm_hs_testing.requests import greedy


def speculative_cases(
    prompts: Sequence[list[int]], windows: list[list[int]]
) -> list[Case]:
    """Eight requests for a speculative engine, one per prompt: states and none,
    output states only, position `windows`, the last row, a layer subset, and
    max_tokens that end inside a draft step."""
    assert len(prompts) == 8, len(prompts)
    main = list(MAIN_RESOLVED)
    table: list[tuple[dict[str, Any] | None, Expect | None]] = [
        ({}, Expect(main)),
        ({}, Expect(main)),
        (None, None),
        ({"prompt": False}, Expect(main, prompt=False)),
        ({}, Expect(main)),
        ({"positions": windows}, Expect(main, positions=windows)),
        ({"positions": "last"}, Expect(main, positions="last")),
        ({"layers": ["final_norm", 0]}, Expect(["final_norm", 0])),
    ]
    max_tokens = (40, 7, 33, 40, 2, 40, 19, 40)
    return [
        (prompt, greedy(tokens, hidden_states=hs), expect)
        for prompt, tokens, (hs, expect) in zip(prompts, max_tokens, table, strict=True)
    ]


def check_stop_inside_drafts(
    llm: Any,
    model_dir: str,
    prompts: Sequence[Sequence[int]],
    layers: list[int | str],
    label: str,
) -> None:
    """A stop token among a step's accepted drafts: for each prompt, stop at
    the first greedy token (from position 6) not seen before it in HF's
    greedy continuation; the tokens after it and their rows are dropped, so
    the rows, checked against HF, end at the stop token's input. `layers`:
    the engine's resolved layer ids."""
    from vllm_hs.hf_reference import hf_greedy

    cases = []
    for prompt in prompts:
        reference = hf_greedy(model_dir, prompt, 30)
        k = next(j for j in range(6, 30) if reference[j] not in reference[:j])
        sp = greedy(30, stop_token_ids=[reference[k]], hidden_states={})
        cases.append((list(prompt), sp, Expect(layers)))
    outputs = run_cases(llm, cases, model_dir, torch.float32, label)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.hidden_states.shape[0] == len(completion.token_ids) - 1
