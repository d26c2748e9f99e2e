"""vllm_hs.extract.storage: --storage-dtype's conversions, without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm_hs.extract.storage import (
    FP8,
    SCALES_KEY,
    encode_states,
    reading_note,
    stored_dtype,
)


def _states() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    states = torch.randn(6, 3, 16, generator=g) * 40
    states[2] = 0.0  # a token whose rows are all zero: the scale's floor
    states[4, 1, 5] = 1e-6  # a subnormal in fp8 after scaling
    return states


def test_stored_dtype_and_reading_note():
    assert stored_dtype("auto", "bfloat16") == "bfloat16"
    assert stored_dtype("float16", "float32") == "float16"
    assert stored_dtype("fp8", "bfloat16") == FP8
    with pytest.raises(ValueError, match="int8"):
        stored_dtype("int8", "float32")
    assert reading_note("bfloat16") is None
    assert "FP8Transfer" in reading_note(FP8)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_fp8_equals_hs_connectors_quantization(model_dtype):
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    states = _states().to(model_dtype)
    tensors, problem = encode_states(states, FP8)
    assert problem is None
    fp8, scales = quantize_tensor_to_fp8(states)
    assert torch.equal(
        tensors["hidden_states"].view(torch.uint8), fp8.view(torch.uint8)
    )
    assert torch.equal(tensors[SCALES_KEY], scales)
    assert tensors[SCALES_KEY].shape == (6, 1, 1)
    assert tensors[SCALES_KEY][2].item() == pytest.approx(1e-12)


def test_conversions_round_and_float16_overflow_is_refused():
    states = _states()
    tensors, problem = encode_states(states, "bfloat16")
    assert problem is None
    assert torch.equal(tensors["hidden_states"], states.to(torch.bfloat16))
    same, problem = encode_states(states, "float32")
    assert problem is None and same["hidden_states"] is states
    states[3, 2, 7] = 1e6
    tensors, problem = encode_states(states, "float16")
    assert tensors == {}
    assert "beyond float16's range (first at row 3, column 2)" in problem
