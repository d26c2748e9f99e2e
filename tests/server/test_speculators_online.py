"""speculators' online training against a real patched `vllm serve`: its
ArrowDataset, with `on_missing="generate"` and the `vllm-hs` backend
(vllm_hs.client.speculators_online), asks the server for every sample and the rows it
hands to training equal HF transformers' rows; nothing goes through files."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_hs.hf_reference import assert_states_close, hf_hidden_states
from vllm_hs_testing.extract_output import (
    assert_speculators_item_equals_hf,
    online_dataset,
)

NUM = 4
HIDDEN = 128


def test_backend_is_a_choice_of_speculators_train():
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hs.client.speculators_online", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "{file,fp8,mooncake,vllm-hs}" in proc.stdout


def test_dataset_generates_hf_rows_from_the_server(
    online_server, model_dir, tmp_path: Path
):
    from vllm_hs.client.speculators_online import VllmHsBackend
    from vllm_hs.extract.records import HS_DIR

    transfer = VllmHsBackend.from_train_args(
        argparse.Namespace(
            hidden_states_path=None, vllm_endpoint=online_server.base_url
        ),
        str(tmp_path),
    )
    dataset, rendered = online_dataset(
        tmp_path, model_dir, transfer, online_server.base_url, NUM
    )
    for i, (ids, mask) in enumerate(rendered):
        item = dataset[i]
        assert item["loss_mask"].tolist() == mask
        assert_speculators_item_equals_hf(item, model_dir, ids, f"sample {i}")
    assert not list((tmp_path / HS_DIR).iterdir()), "states went through files"
    # speculators deleted each sample's reference once it had checked it.
    assert transfer._urls == {}


def test_a_request_asking_for_states_is_answered_as_usual(online_server, model_dir):
    """The server answers requests that ask in the usual fields, and plain
    ones in kv_transfer_params."""
    import openai

    client = openai.OpenAI(
        base_url=online_server.base_url, api_key="x", timeout=120.0, max_retries=0
    )
    prompt = [11, 12, 13, 14, 15]
    plain = client.completions.create(
        model=model_dir,
        prompt=prompt,
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    params = plain.kv_transfer_params
    assert params["token_ids"] == prompt and params["handle"]
    payload = params["hidden_states"]
    assert payload["shape"] == [5, 4, HIDDEN] and payload["encoding"] == "ref"
    assert "data" not in payload  # a handle, not the rows
    from vllm_hs.client.speculators_online import RefTransfer

    transfer = RefTransfer(online_server.base_url)
    got = transfer.get_generated(params)
    expected = hf_hidden_states(model_dir, prompt, [1, 2, 3, 4])
    assert_states_close(got["hidden_states"], expected, dtype=torch.float32, what="ref")
    transfer.delete(params["handle"])
    with pytest.raises(ValueError, match="HTTP 404"):
        transfer.get_generated(params)
    asked = client.completions.create(
        model=model_dir,
        prompt=prompt,
        max_tokens=2,
        extra_body={"hidden_states": {"layers": [4]}},
    )
    assert asked.kv_transfer_params is None
    choice = asked.choices[0].model_extra
    assert choice["prompt_hidden_states"]["shape"] == [5, 1, HIDDEN]
    assert choice["hidden_states"]["shape"] == [1, 1, HIDDEN]
    client.close()
