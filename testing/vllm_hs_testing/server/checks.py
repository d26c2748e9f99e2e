"""Checks of collected responses against HF transformers.

Every check recomputes the expected rows with `vllm_hs.hf_reference` from the
token ids the server returned (`"return_token_ids": true`), so a row from the
wrong position, layer, choice or request fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vllm_hs.hf_reference import assert_states_close, hf_sequence_states
from vllm_hs.layer_ids import resolve_layer_ids
from vllm_hs_testing.main_engine import HIDDEN, MAIN_LAYERS, MAIN_RESOLVED, NUM_LAYERS
from vllm_hs_testing.server.parsing import Collected, get

DTYPE = torch.float32


def resolve(layers: list[int | str] | None) -> list[int | str]:
    """Layer ids as the server reports them (None = the whole server set)."""
    if layers is None:
        return list(MAIN_RESOLVED)
    return resolve_layer_ids(layers, NUM_LAYERS)


@dataclass
class Want:
    """What a request asked for: `layers` as sent (None = server default)."""

    layers: list[int | str] | None = None
    prompt: bool = True
    output: bool = True


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """HF references on one thread: the server shares the (few) cores, and
    idle-spinning OpenMP threads here would slow every server step."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def reference(
    model_dir: str, prompt_ids: list[int], tokens: list[int], layers: list[int | str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `(prompt rows, output rows)` of a sequence, in float32."""
    with one_torch_thread():
        return hf_sequence_states(model_dir, prompt_ids, tokens, layers, dtype=DTYPE)


def check(
    model_dir: str,
    got: Collected,
    want: Want | None,
    what: str,
    *,
    n: int = 1,
    stream: bool = False,
) -> None:
    """Check every hidden-state row of a collected response against HF.

    `want=None`: the request did not ask for states, so none may come."""
    assert len(got.token_ids) == n, f"{what}: choices {sorted(got.token_ids)}"
    if want is None:
        assert not got.payloads, f"{what}: unasked states {got.payloads[:1]}"
        return
    layers = resolve(want.layers)
    ref_layers = list(want.layers) if want.layers is not None else list(MAIN_LAYERS)
    for kind, index, payload in got.payloads:
        assert list(get(payload, "layers")) == layers, (what, kind, index)
        assert get(payload, "dtype") == "float32", (what, get(payload, "dtype"))
        shape = list(get(payload, "shape"))
        assert shape[1:] == [len(layers), HIDDEN], (what, kind, index, shape)
    prompt_key = 0  # chat: the response; completions: first choice of the prompt
    prompt_ids = got.prompt_ids.get(prompt_key)
    assert prompt_ids, f"{what}: no prompt_token_ids (return_token_ids)"
    if not got.chat:
        for index, ids in got.prompt_ids.items():
            assert ids == prompt_ids, f"{what}: choice {index} has other prompt ids"
    sent = [index for kind, index, _ in got.payloads if kind == "prompt"]
    if want.prompt:
        assert sent == [prompt_key], (
            f"{what}: prompt_hidden_states sent {len(sent)} times (choices {sent}), "
            f"want once (on {prompt_key})"
        )
        assert sorted(got.states.prompts) == [prompt_key], (
            f"{what}: prompt states on {sorted(got.states.prompts)}, want once on "
            f"{prompt_key}"
        )
    else:
        assert not got.states.prompts, f"{what}: prompt states despite prompt=false"
    if not want.output:
        assert not got.states.outputs, f"{what}: output states despite output=false"
    for index in range(n):
        tokens = got.token_ids[index]
        assert tokens, f"{what}: choice {index} has no token_ids"
        ref_prompt, ref_output = reference(model_dir, prompt_ids, tokens, ref_layers)
        if want.prompt and index == prompt_key:
            rows = got.states.prompt(prompt_key)
            assert rows.dtype == DTYPE, (what, rows.dtype)
            assert_states_close(
                rows, ref_prompt, dtype=DTYPE, what=f"{what} prompt", layers=layers
            )
        if want.output:
            rows = got.states.output(index)
            if rows is None:
                # Streams send no output payload while there are no rows.
                assert stream and len(tokens) == 1, f"{what}: no output states {index}"
                rows = torch.empty(0, len(layers), HIDDEN, dtype=DTYPE)
            assert rows.shape == (len(tokens) - 1, len(layers), HIDDEN), (
                f"{what} choice {index}: shape {tuple(rows.shape)} for "
                f"{len(tokens)} tokens"
            )
            assert_states_close(
                rows,
                ref_output,
                dtype=DTYPE,
                what=f"{what} choice {index} output",
                layers=layers,
                row_offset=len(prompt_ids),
            )
    if stream:
        check_stream_timing(got, want, what)


def check_stream_timing(got: Collected, want: Want, what: str) -> None:
    """Deltas arrive as they are made: after every chunk with tokens, a
    choice holds tokens - 1 output rows; prompt rows come with the first token."""
    if want.output:
        for index, rows, tokens in got.rows_vs_tokens:
            assert rows == tokens - 1, (
                f"{what}: choice {index} had {rows} output rows after {tokens} "
                "tokens in the stream (want tokens - 1)"
            )
    if want.prompt:
        assert got.prompt_chunk.get(0) == 1, (
            f"{what}: prompt states came in token chunk {got.prompt_chunk}, "
            "want with the first token"
        )
