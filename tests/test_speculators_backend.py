"""`vllm_hs.client.speculators_online` without a server: the backend's transfer reads
extracted hs files first (--hidden-states-path), decodes a server's
kv_transfer_params, and refuses a response without states."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from vllm_hs.extract.formats.speculators import save_hs_file


def _transfer(path: Path | None):
    from vllm_hs.client.speculators_online import VllmHsBackend

    args = argparse.Namespace(
        hidden_states_path=str(path) if path else None,
        vllm_endpoint="http://127.0.0.1:9/v1",
    )
    return VllmHsBackend.from_train_args(args, "unused")


def test_extracted_files_are_read_first(tmp_path: Path):
    rows = torch.randn(5, 4, 8)
    ids = torch.arange(5, dtype=torch.int64)
    save_hs_file(
        tmp_path / "hs_0.safetensors", {"hidden_states": rows}, ids, 0, [1] * 5
    )
    transfer = _transfer(tmp_path)
    cached = transfer.get_cached(0)
    assert torch.equal(cached["hidden_states"], rows)
    assert torch.equal(cached["token_ids"], ids)
    assert transfer.get_cached(1) is None  # not extracted: speculators generates
    assert _transfer(None).get_cached(0) is None


def test_states_come_from_kv_transfer_params():
    from vllm.entrypoints.openai.hidden_states import encode_hidden_states

    rows = torch.randn(3, 2, 8).to(torch.bfloat16)
    params = {
        "handle": "cmpl-1",
        "hidden_states": encode_hidden_states(rows, [1, 4], "base64").model_dump(),
        "token_ids": [5, 6, 7],
    }
    got = _transfer(None).get_generated(params)
    assert torch.equal(got["hidden_states"], rows)
    assert got["token_ids"].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="respond_in_kv_transfer_params"):
        _transfer(None).get_generated({"handle": "cmpl-2", "token_ids": [1]})
    with pytest.raises(ValueError, match="3 hidden-state rows for 2 tokens"):
        _transfer(None).get_generated({**params, "token_ids": [5, 6]})
