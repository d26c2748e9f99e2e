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


def test_layers_a_deepstack_decoder_changes_are_refused_at_start(tmp_path):
    """Qwen3-VL adds its vision encoder's features to the residual stream after
    its first decoder layers (deepstack): there the state entering layer k is
    not HF's hidden_states[k] at image positions. Those ids are refused when
    the engine is configured, naming the model and the ids it serves."""
    from transformers import Qwen3VLConfig
    from vllm import LLM

    config = Qwen3VLConfig(
        text_config={
            "num_hidden_layers": 4,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 512,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "out_hidden_size": 64,
            "num_heads": 2,
            "intermediate_size": 64,
            "deepstack_visual_indexes": [0, 1],
        },
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"Qwen3VLForConditionalGeneration adds .*deepstack.* layers 1\.\.2, "
        r"so layer ids \[2\] .* Use ids 0, 3\.\.4 or 'final_norm'",
    ):
        LLM(
            model=str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            hidden_states_config={"layers": [2, 4]},
        )
