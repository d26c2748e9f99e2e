"""Image input a model cannot take is refused before the engine, and the
engine serves on (the server's refusals: test_server.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_hs.models.tiny import build_tiny_model
from vllm_hs.models.tiny_vl import seeded_image
from vllm_hs_testing.engines import engine
from vllm_hs_testing.hf_checks import Expect, check_output
from vllm_hs_testing.requests import greedy, tokens_prompt


def test_an_image_sent_to_a_text_only_model_is_refused():
    model_dir = str(build_tiny_model("llama", "float32"))
    with engine(
        model_dir,
        "inproc",
        dtype="float32",
        hidden_states_config={"layers": [1]},
        enforce_eager=True,
    ) as llm:
        image_prompt = {
            "prompt": "Hello there",
            "multi_modal_data": {"image": seeded_image(1)},
        }
        with pytest.raises(ValueError, match="text-only model"):
            llm.generate(image_prompt, greedy(2, hidden_states=True), use_tqdm=False)
        out = llm.generate(
            tokens_prompt([9, 10, 11]), greedy(2, hidden_states=True), use_tqdm=False
        )
        check_output(
            out[0], model_dir, Expect(layers=[1]), torch.float32, "after the refusal"
        )


def test_a_reference_refused_for_its_images_leaves_no_hooks(vl_fp32):
    from vllm_hs.hf_reference import hf_hidden_states, load_hf_model

    # No image token in the sequence for one image: refused before any hook.
    with pytest.raises(ValueError, match="image tokens"):
        hf_hidden_states(
            vl_fp32, [9, 10, 11], [1], dtype=torch.float32, images=[seeded_image(1)]
        )
    model = load_hf_model(vl_fp32, torch.float32)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
