"""Reading back what `vllm-hs extract` wrote (speculators' format): the Arrow
dataset with every sample's safetensors file, and a file's vllm-hs metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_hs.extract.records import HS_DIR


def load_output(output: Path) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    from datasets import load_from_disk
    from safetensors.torch import load_file

    data = load_from_disk(str(output))
    files = [
        load_file(str(output / HS_DIR / f"hs_{i}.safetensors"))
        for i in range(len(data))
    ]
    assert len(list((output / HS_DIR).iterdir())) == len(data)
    return data, files


def hs_metadata(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["vllm_hs"])
