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


def assert_speculators_item_equals_hf(
    item: dict[str, torch.Tensor], model_dir: str, ids: list[int], what: str
) -> None:
    """One item of speculators' dataset, generated online from a patched
    server whose layers are the tiny model's [1, 2, 3, 4]: its aux layers and
    verifier's last state equal HF's rows of `ids`."""
    from vllm_hs.hf_reference import assert_states_close, hf_hidden_states

    assert item["input_ids"].tolist() == ids, what
    expected = hf_hidden_states(model_dir, ids, [1, 2, 3, 4])
    hidden = expected.shape[-1]
    assert_states_close(
        item["hidden_states"],
        expected[:, :3].reshape(len(ids), 3 * hidden),
        dtype=torch.float32,
        what=f"{what} aux layers",
    )
    assert_states_close(
        item["verifier_last_hidden_states"],
        expected[:, 3],
        dtype=torch.float32,
        what=f"{what} verifier last",
    )


def online_dataset(
    path: Path, model_dir: str, transfer: Any, endpoint: str, num: int
) -> tuple[Any, list[tuple[list[int], list[int]]]]:
    """speculators' ArrowDataset for online training over the first `num`
    shipped conversations, rendered with the model's chat template: the token
    dataset without hidden-state files (what speculators' prepare_data leaves),
    each sample's states generated from `endpoint` through `transfer`.
    (dataset, the (token ids, loss mask) of each sample)."""
    from array import array

    from speculators.train.data import ArrowDataset
    from transformers import AutoTokenizer

    from vllm_hs.extract.dataset import write_arrow
    from vllm_hs.extract.inputs import (
        load_conversations,
        render_with_mask,
        shipped_conversations_path,
    )
    from vllm_hs.extract.records import Row

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = load_conversations(shipped_conversations_path())[0][:num]
    rendered = [render_with_mask(tokenizer, c) for c in conversations]
    write_arrow(path, [Row(array("i", ids), bytes(mask)) for ids, mask in rendered])
    (path / HS_DIR).mkdir()
    dataset = ArrowDataset(
        max_len=512,
        datapath=str(path),
        transfer=transfer,
        vllm_endpoint=endpoint,
        on_missing="generate",
        hidden_states_dtype=torch.float32,
    )
    return dataset, rendered
