"""vllm-hs extract on a bfloat16 Qwen3 (its own in-process engine): states stay
bf16, match HF within bf16 tolerances, and speculators reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_hs.extract.records import HS_DIR, MANIFEST
from vllm_hs.hf_reference import assert_states_close, hf_hidden_states

LAYERS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def qwen3_bf16() -> str:
    from vllm_hs.models.tiny import build_tiny_model

    return str(build_tiny_model("qwen3", "bfloat16"))


@pytest.fixture(scope="module")
def bf16_llm(qwen3_bf16: str, inproc_engine):
    with inproc_engine(qwen3_bf16, dtype="bfloat16", max_model_len=512) as engine:
        yield engine


def test_bf16_states_stay_bf16_and_match_hf(
    bf16_llm, qwen3_bf16, shipped, tmp_path: Path, run_extract
):
    from safetensors.torch import load_file
    from speculators.train.data import ArrowDataset

    out = tmp_path / "bf16"
    result = run_extract(bf16_llm, shipped[:12], out)
    assert result.samples == 12
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["max_length"] == 511
    for i in range(12):
        hs = load_file(str(out / HS_DIR / f"hs_{i}.safetensors"))
        assert hs["hidden_states"].dtype == torch.bfloat16
        expected = hf_hidden_states(qwen3_bf16, hs["token_ids"].tolist(), LAYERS)
        assert expected.dtype == torch.bfloat16
        assert_states_close(
            hs["hidden_states"],
            expected,
            dtype=torch.bfloat16,
            what=f"bf16 sample {i}",
            layers=LAYERS,
        )
    dataset = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise")
    item = dataset[3]
    assert item["hidden_states"].dtype == torch.bfloat16
    assert item["hidden_states"].shape[1] == 3 * 128
