"""A tiny, seeded, offline vision-language target: Qwen2.5-VL.

`build_tiny_vl_model` writes a directory that transformers
(`Qwen2_5_VLForConditionalGeneration`, `AutoProcessor`) and vLLM
(`Qwen2_5_VLForConditionalGeneration`) load without any network access: config,
seeded weights, tokenizer, chat template, image and video processor configs.
It follows `vllm_hs.models.tiny` (weights redrawn per parameter from
``(seed, name)``, a byte-level BPE tokenizer trained on the same synthetic corpus,
the same ChatML template, the same cache layout) with these additions:

* **Tokens.** The special tokens of `vllm_hs.models.tiny` (ids 0-4), then
  ``<|vision_start|>``=5, ``<|vision_end|>``=6, ``<|image_pad|>``=7 (the
  image token), ``<|video_pad|>``=8. Text-only prompts should use ids >= 9.
* **Chat template.** A message's content is a string or an OpenAI-style list of
  parts: an image part (``{"type": "image"}``, ``{"type": "image_url"}``)
  renders as ``<|vision_start|><|image_pad|><|vision_end|>``, which the
  processor (and vLLM) expand to one ``<|image_pad|>`` per merged patch; a text
  part renders its text.
* **Sizes.** Text: hidden 64, 2 layers, 2 heads of 32 (vLLM's CPU attention
  needs 32), M-RoPE sections (4, 6, 6). Vision: depth 2, hidden 64, patches of
  14 px merged 2x2 (28 px per image token), block 0 windowed (56 px windows),
  block 1 full attention. Images are resized to between 56x56 and 112x112 px:
  4 to 16 image tokens each.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from vllm_hs.models.tiny import (
    CHAT_TEMPLATE,
    DTYPES,
    SPECIAL_TOKENS,
    build_cached,
    normalize_tokenizer_config,
    redraw_weights,
    train_tokenizer,
)

__all__ = [
    "IMAGE_TOKEN",
    "VL_SPECIAL_TOKENS",
    "build_tiny_vl_model",
    "seeded_image",
]

#: Bump when the files a build writes change for the same arguments.
FORMAT_VERSION = 1

VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VL_SPECIAL_TOKENS: tuple[str, ...] = (
    *SPECIAL_TOKENS,
    VISION_START,
    VISION_END,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
)

_PATCH, _MERGE, _TEMPORAL_PATCH = 14, 2, 2
_TOKEN_PX = _PATCH * _MERGE
#: Resized images have between 2x2 and 4x4 image tokens.
_MIN_PIXELS, _MAX_PIXELS = 4 * _TOKEN_PX**2, 16 * _TOKEN_PX**2
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

_IMAGE_ITEM = VISION_START + IMAGE_TOKEN + VISION_END
_VIDEO_ITEM = VISION_START + VIDEO_TOKEN + VISION_END
#: `vllm_hs.models.tiny.CHAT_TEMPLATE` with content lists (module docstring).
VL_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] in ('image', 'image_url', 'image_pil')"
    " or 'image' in part or 'image_url' in part -%}"
    "{{- '" + _IMAGE_ITEM + "' -}}"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part -%}"
    "{{- '" + _VIDEO_ITEM + "' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
) + CHAT_TEMPLATE.replace("message['content']", "render(message['content'])")


def build_tiny_vl_model(
    dtype: str = "float32", *, seed: int = 0, cache_dir: Path | None = None
) -> Path:
    """Build (or reuse from the cache) the tiny Qwen2.5-VL; return its path."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    args = {"format_version": FORMAT_VERSION, "dtype": dtype, "seed": seed}
    return build_cached(f"qwen2_5_vl-{dtype}", args, _write_model, cache_dir)


def vision_config(out_hidden_size: int) -> dict[str, Any]:
    """The tiny vision tower's config (Qwen2.5-VL's vision_config): a windowed
    and a full-attention block, its merged outputs `out_hidden_size` wide (the
    language model's hidden size)."""
    return dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        in_channels=3,
        hidden_act="silu",
        patch_size=_PATCH,
        spatial_merge_size=_MERGE,
        temporal_patch_size=_TEMPORAL_PATCH,
        tokens_per_second=2,
        window_size=2 * _TOKEN_PX,
        fullatt_block_indexes=[1],
        out_hidden_size=out_hidden_size,
    )


def seeded_image(seed: int, width: int = 56, height: int = 56) -> Any:
    """A deterministic RGB noise image (PIL)."""
    from PIL import Image

    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def _processor_config(kind: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        f"{kind}_processor_type": f"Qwen2VL{kind.capitalize()}Processor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "size": {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS},
        "patch_size": _PATCH,
        "temporal_patch_size": _TEMPORAL_PATCH,
        "merge_size": _MERGE,
    }
    if kind == "video":
        # Per-frame sizing only, as vLLM counts video tokens.
        config.update(do_sample_frames=False, cap_pixels_per_frame=False)
    return config


def _weight_std(name: str, param: Any) -> float | None:
    # Patch embeddings of O(1): the Conv3d's fan-in is 3 x 2 x 14 x 14.
    if name.endswith("patch_embed.proj.weight"):
        return param[0].numel() ** -0.5
    return None


def _write_model(out: Path, args: dict[str, Any]) -> None:
    import torch
    import transformers

    tokenizer = train_tokenizer(args["seed"], 384, VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    special = dict(
        bos_token_id=ids[SPECIAL_TOKENS[0]],
        eos_token_id=ids[SPECIAL_TOKENS[1]],
        pad_token_id=ids[SPECIAL_TOKENS[2]],
    )
    text_config = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        # M-RoPE sections (t, h, w) sum to head_dim / 2 = 16.
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [4, 6, 6],
            "rope_theta": 1e6,
        },
        tie_word_embeddings=False,
        use_sliding_window=False,
        **special,
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config(out_hidden_size=64),
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
        **special,
    )
    torch.manual_seed(args["seed"])
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    redraw_weights(
        model,
        args["seed"],
        norm_modules=("ln_q",),
        qk_modules=("q_proj", "k_proj", "qkv"),
        std=_weight_std,
    )
    torch_dtype = getattr(torch, args["dtype"])
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config = transformers.GenerationConfig(**special)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokenizer_config = out / "tokenizer_config.json"
    normalize_tokenizer_config(tokenizer_config)
    data = json.loads(tokenizer_config.read_text())
    data["processor_class"] = "Qwen2_5_VLProcessor"
    tokenizer_config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    # Written here, not by a processor class: the same files whether or not
    # torchvision is installed.
    for name, kind in (
        ("preprocessor_config.json", "image"),
        ("video_preprocessor_config.json", "video"),
    ):
        (out / name).write_text(
            json.dumps(_processor_config(kind), indent=2, sort_keys=True) + "\n"
        )
