"""Start real (patched) vLLM engines and check their hidden states against HF.

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
from vllm_hs.testing import engine  # noqa: F401  (re-exported for the tests)

MODES = ("inproc", "mp")
"""Engine modes: the in-process engine core (no serialization) and the default
multiprocess engine (worker -> core over shared memory, core -> frontend over
msgpack)."""


# Layer set of the main test engine (conftest.py); -1 resolves to L=4.
MAIN_LAYERS: list[int | str] = [0, 2, -1, "final_norm"]
MAIN_RESOLVED: list[int | str] = [0, 2, 4, "final_norm"]
ROW_BYTES = 4 * 128 * 4  # 4 layers x hidden 128 x fp32
CAP_BYTES = 256 * ROW_BYTES
BUDGET = 32  # max_num_batched_tokens: long prompts prefill in many chunks
PREFIX_STORE_BLOCKS = 4  # rows of 32-token blocks the main engine keeps
PREFIX_STORE_BYTES = PREFIX_STORE_BLOCKS * 32 * ROW_BYTES


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


def tokens_prompt(token_ids: Sequence[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(token_ids))


def seeded_prompt(seed: int, length: int, vocab: int = 1024, low: int = 8) -> list[int]:
    """Deterministic token ids in [low, vocab) (below `low`: special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (length,), generator=g).tolist()


@dataclass
class Expect:
    """What a request asked for, resolved to the layer ids of its columns."""

    layers: list[int | str]
    prompt: bool = True
    output: bool = True


def check_output(
    request_output: Any,
    model_dir: str,
    expect: Expect | None,
    dtype: torch.dtype | str,
    what: str,
    tolerance_dtype: torch.dtype | str | None = None,
) -> None:
    """Check every hidden-state row of one RequestOutput (all completions).

    The reference runs in `dtype`; tolerances are those of `tolerance_dtype`
    (default: `dtype`)."""
    tol_dtype = dtype if tolerance_dtype is None else tolerance_dtype
    prompt_ids = list(request_output.prompt_token_ids)
    if expect is None:
        assert request_output.prompt_hidden_states is None, what
        for completion in request_output.outputs:
            assert completion.hidden_states is None, what
        return
    prompt_rows = request_output.prompt_hidden_states
    checked_prompt = False
    for completion in request_output.outputs:
        token_ids = list(completion.token_ids)
        ref_prompt, ref_output = hf_sequence_states(
            model_dir, prompt_ids, token_ids, expect.layers, dtype=dtype
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
