"""The frontend's row buffers, driven through vLLM's own output classes:
merging many DELTA outputs (a consumer that falls behind) is linear, and a
tensor handed out never changes afterwards.

The engine never trims rows it already handed out in CUMULATIVE mode except
when a stop string ends the request; these tests drive the same classes with
`EngineCoreOutput`s built here to pin the invariant down in every order.
"""

from __future__ import annotations

import pytest
import torch

ROW = (2, 4)  # layers x hidden of the synthetic rows


def _rows(start: int, end: int) -> torch.Tensor:
    positions = torch.arange(start, end, dtype=torch.float32)
    return positions[:, None, None].expand(-1, *ROW).contiguous()


def _completion(rows: torch.Tensor | None, index: int = 0):
    from vllm.outputs import CompletionOutput

    return CompletionOutput(
        index=index,
        text="",
        token_ids=[],
        cumulative_logprob=None,
        logprobs=None,
        hidden_states=rows,
    )


def _request_output(rows: torch.Tensor | None):
    from vllm.outputs import RequestOutput

    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[_completion(rows)],
        finished=False,
    )


def test_merging_deltas_is_linear_and_exact():
    """1000 one-row deltas merged into one output (RequestOutput.add, as
    AsyncLLM's collector does while its consumer is busy): the merged rows are
    the concatenation, built in O(log n) allocations, not one per merge."""
    merged = _request_output(_rows(0, 1))
    storages = set()
    for p in range(1, 1000):
        merged.add(_request_output(_rows(p, p + 1)), aggregate=True)
        storages.add(merged.outputs[0].hidden_states.untyped_storage().data_ptr())
    assert torch.equal(merged.outputs[0].hidden_states, _rows(0, 1000))
    assert len(storages) <= 12, f"{len(storages)} buffers for 999 merges"


def test_merged_output_handed_out_never_changes():
    """An output taken from the collector is never written by later merges
    into the next output, nor are the engine's own delta tensors."""
    first_rows = _rows(0, 3)
    merged = _request_output(first_rows)
    merged.add(_request_output(_rows(3, 5)), aggregate=True)
    handed_out = merged.outputs[0].hidden_states
    snapshot = handed_out.clone()
    merged.add(_request_output(_rows(5, 9)), aggregate=True)
    assert torch.equal(handed_out, snapshot)
    assert torch.equal(first_rows, _rows(0, 3)), "an engine delta was written"
    nxt = _request_output(_rows(9, 10))
    nxt.add(_request_output(_rows(10, 12)), aggregate=True)
    assert torch.equal(handed_out, snapshot)
    assert torch.equal(nxt.outputs[0].hidden_states, _rows(9, 12))


def _state(kind: str):
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.hidden_states.output import RequestOutputHiddenStates

    return RequestOutputHiddenStates(None, True, RequestOutputKind[kind])


def _engine_output(rows: torch.Tensor):
    from vllm.v1.engine import AuxOutputs, EngineCoreOutput

    return EngineCoreOutput(
        request_id="r", new_token_ids=[0], aux_outputs=AuxOutputs(hidden_states=rows)
    )


@pytest.mark.parametrize("trim", [False, True])
def test_cumulative_outputs_never_change_after_hand_out(trim):
    """CUMULATIVE hands out every row so far at each output. A tensor handed
    out keeps its values whatever comes later, also when rows were trimmed
    (a stop string) and more rows arrived after that."""
    state = _state("CUMULATIVE")
    handed_out: list[torch.Tensor] = []
    snapshots: list[torch.Tensor] = []

    def hand_out(num_output_tokens: int) -> None:
        rows, positions = state.output_rows(num_output_tokens, finished=False)
        assert positions is None  # every position: rows are not labelled
        handed_out.append(rows)
        snapshots.append(rows.clone())

    state.add(_engine_output(_rows(0, 3)))
    hand_out(4)
    if trim:
        hand_out(3)  # 2 rows kept
    state.add(_engine_output(_rows(20, 24)))
    hand_out(100)
    for p in range(24, 200):
        state.add(_engine_output(_rows(p, p + 1)))
        state.output_rows(num_output_tokens=1000, finished=False)
    for t, snap in zip(handed_out, snapshots, strict=True):
        assert torch.equal(t, snap), "a tensor handed out changed afterwards"
    kept = 2 if trim else 3
    assert torch.equal(handed_out[-1][:kept], _rows(0, kept))
    assert torch.equal(handed_out[-1][kept:], _rows(20, 24))
