"""Checks of a request's hidden-state rows against HF transformers, shared by
the engine tests (tests/engine; `vllm_hs_testing.server.checks` does the same
for server responses).

Every check recomputes the expected rows with HF transformers on the same weights
(`vllm_hs.hf_reference`) from the request's own prompt and generated tokens, so
a row from the wrong position, layer or request fails, as do zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hs.hf_reference import assert_states_close, hf_sequence_states
from vllm_hs_testing.main_engine import MAIN_RESOLVED
from vllm_hs_testing.requests import greedy, tokens_prompt


@dataclass
class Expect:
    """What a request asked for, resolved to the layer ids of its columns."""

    layers: list[int | str]
    prompt: bool = True
    output: bool = True
    positions: str | list[list[int]] | None = None
    """`HiddenStatesParams.positions` of the request."""

    def selected(self, num_prompt: int, num_tokens: int) -> tuple[list[int], list[int]]:
        """(prompt positions, generated positions) whose rows the request
        returns, computed here from the documented conventions: "last" is
        P-1 and P+G-2 (none when G=1); windows are [start, end) ranges."""
        prompt = list(range(num_prompt)) if self.prompt else []
        output = list(range(num_prompt, num_prompt + num_tokens - 1))
        if not self.output:
            output = []
        if self.positions == "last":
            return prompt[-1:], output[-1:]
        if self.positions is not None:
            wanted = {p for start, end in self.positions for p in range(start, end)}
            prompt = [p for p in prompt if p in wanted]
            output = [p for p in output if p in wanted]
        return prompt, output


def check_output(
    request_output: Any,
    model_dir: str,
    expect: Expect | None,
    dtype: torch.dtype | str,
    what: str,
    tolerance_dtype: torch.dtype | str | None = None,
    images: Sequence[Any] = (),
) -> None:
    """Check every hidden-state row of one RequestOutput (all completions).

    The reference runs in `dtype`; tolerances are those of `tolerance_dtype`
    (default: `dtype`). `images`: the request's images, in prompt order, for a
    vision-language model."""
    tol_dtype = dtype if tolerance_dtype is None else tolerance_dtype
    prompt_ids = list(request_output.prompt_token_ids)
    if expect is None:
        assert request_output.prompt_hidden_states is None, what
        for completion in request_output.outputs:
            assert completion.hidden_states is None, what
        return
    if expect.positions is not None:
        _check_selected_rows(request_output, model_dir, expect, dtype, what, tol_dtype)
        return
    prompt_rows = request_output.prompt_hidden_states
    checked_prompt = False
    for completion in request_output.outputs:
        token_ids = list(completion.token_ids)
        ref_prompt, ref_output = hf_sequence_states(
            model_dir, prompt_ids, token_ids, expect.layers, dtype=dtype, images=images
        )
        label = f"{what} completion {completion.index}"
        if expect.prompt and not checked_prompt:
            assert prompt_rows is not None, f"{what}: no prompt_hidden_states"
            assert prompt_rows.dtype == ref_prompt.dtype, (prompt_rows.dtype, what)
            assert_states_close(
                prompt_rows,
                ref_prompt,
                dtype=tol_dtype,
                what=f"{what} prompt",
                layers=expect.layers,
            )
            checked_prompt = True
        elif not expect.prompt:
            assert prompt_rows is None, f"{what}: unexpected prompt states"
        if expect.output:
            rows = completion.hidden_states
            assert rows is not None, f"{label}: no hidden_states"
            assert rows.shape[0] == max(len(token_ids) - 1, 0), (
                f"{label}: {rows.shape[0]} rows for {len(token_ids)} tokens"
            )
            assert_states_close(
                rows,
                ref_output,
                dtype=tol_dtype,
                what=f"{label} output",
                layers=expect.layers,
                row_offset=len(prompt_ids),
            )
        else:
            assert completion.hidden_states is None, f"{label}: unexpected rows"


def _check_selected_rows(
    request_output: Any,
    model_dir: str,
    expect: Expect,
    dtype: torch.dtype | str,
    what: str,
    tol_dtype: torch.dtype | str,
) -> None:
    """`check_output` for a request with `positions`: the rows are those of
    the selected positions, in order, and the outputs list those positions."""
    prompt_ids = list(request_output.prompt_token_ids)
    num_prompt = len(prompt_ids)
    prompt_rows = request_output.prompt_hidden_states
    for completion in request_output.outputs:
        token_ids = list(completion.token_ids)
        want_prompt, want_output = expect.selected(num_prompt, len(token_ids))
        ref_prompt, ref_output = hf_sequence_states(
            model_dir, prompt_ids, token_ids, expect.layers, dtype=dtype
        )
        label = f"{what} completion {completion.index}"
        if want_prompt and completion.index == 0:
            assert prompt_rows is not None, f"{what}: no prompt_hidden_states"
            got = request_output.prompt_hidden_states_positions
            assert got == want_prompt, f"{what}: prompt positions {got}"
            assert_states_close(
                prompt_rows,
                ref_prompt[want_prompt],
                dtype=tol_dtype,
                what=f"{what} prompt rows of {want_prompt[:8]}...",
                layers=expect.layers,
            )
        elif not want_prompt:
            assert prompt_rows is None, f"{what}: unexpected prompt states"
        if expect.output:
            rows = completion.hidden_states
            assert rows is not None, f"{label}: no hidden_states"
            got = completion.hidden_states_positions
            assert got == want_output, f"{label}: output positions {got}"
            assert_states_close(
                rows,
                ref_output[[p - num_prompt for p in want_output]],
                dtype=tol_dtype,
                what=f"{label} output rows of {want_output[:8]}...",
                layers=expect.layers,
            )
        else:
            assert completion.hidden_states is None, f"{label}: unexpected rows"


Case = tuple[list[int], Any, "Expect | None"]
"""(prompt token ids, SamplingParams, what the request asked for)."""


def run_cases(
    llm: Any,
    cases: Sequence[Case],
    model_dir: str,
    dtype: torch.dtype | str,
    label: str,
    tolerance_dtype: torch.dtype | str | None = None,
) -> list[Any]:
    """Generate all cases in one batch and check every output against HF."""
    outputs = llm.generate(
        [tokens_prompt(p) for p, _, _ in cases],
        [sp for _, sp, _ in cases],
        use_tqdm=False,
    )
    assert len(outputs) == len(cases)
    for i, (out, (prompt, _, expect)) in enumerate(zip(outputs, cases, strict=True)):
        assert list(out.prompt_token_ids) == list(prompt)
        check_output(out, model_dir, expect, dtype, f"{label} {i}", tolerance_dtype)
    return outputs


def rejected_then_served(
    engine: tuple[Any, str],
    model_dir: str,
    prompt: list[int],
    bad: Any,
    match: str,
    good: dict[str, Any],
) -> None:
    """On an `engine` (llm, mode) of a float32 model: `bad` hidden_states fail
    the request with `match`, then the same prompt with `good` ones is served,
    every row checked against HF."""
    import pytest

    llm, mode = engine
    with pytest.raises(ValueError, match=match):
        llm.generate([tokens_prompt(prompt)], greedy(3, hidden_states=bad))
    (out,) = llm.generate(
        [tokens_prompt(prompt)], greedy(3, hidden_states=good), use_tqdm=False
    )
    expect = Expect(MAIN_RESOLVED, positions=good.get("positions"))
    check_output(out, model_dir, expect, torch.float32, f"[{mode}] after {bad!r}")
