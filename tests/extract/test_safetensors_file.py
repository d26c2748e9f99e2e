"""vllm_hs.extract.safetensors_file against safetensors' own reader and writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_hs.extract.safetensors_file import DTYPE_CODES, write_safetensors


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    states = torch.randn(7, 3, 5, generator=g).to(dtype)
    return {
        # Not contiguous: written as its values, not its memory layout.
        "hidden_states": states.transpose(0, 1).contiguous().transpose(0, 1),
        "token_ids": torch.arange(7, dtype=torch.int64) * 1000,
    }


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
)
def test_safetensors_reads_back_what_was_written(tmp_path: Path, dtype) -> None:
    tensors = _tensors(dtype)
    path = tmp_path / "a.safetensors"
    write_safetensors(path, tensors, {"vllm_hs": json.dumps({"input_index": 3})})
    loaded = load_file(str(path))
    assert sorted(loaded) == ["hidden_states", "token_ids"]
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8))
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["vllm_hs"]) == {"input_index": 3}


def test_same_tensors_and_header_as_safetensors_writes(tmp_path: Path) -> None:
    tensors = _tensors(torch.bfloat16)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    write_safetensors(ours, tensors, {"k": "v"})
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(theirs),
        metadata={"k": "v"},
    )

    def header(path: Path) -> dict:
        raw = path.read_bytes()
        return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])

    # Same entries, offsets, shapes and dtypes: the data sections are equal.
    assert header(ours) == header(theirs)
    assert ours.stat().st_size == theirs.stat().st_size
    assert ours.read_bytes()[-200:] == theirs.read_bytes()[-200:]


def test_empty_tensors_and_no_metadata(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    write_safetensors(
        path,
        {
            "hidden_states": torch.empty(0, 2, 4),
            "token_ids": torch.empty(0, dtype=torch.int64),
        },
    )
    loaded = load_file(str(path))
    assert loaded["hidden_states"].shape == (0, 2, 4)
    assert loaded["token_ids"].shape == (0,)


def test_refuses_what_safetensors_cannot_hold(tmp_path: Path) -> None:
    assert "complex64" not in DTYPE_CODES
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "x", {"x": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "x").exists()
