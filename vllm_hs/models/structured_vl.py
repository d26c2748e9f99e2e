"""The structured target with a vision tower: a tiny Qwen2.5-VL whose
language model is `vllm_hs.models.structured_target`'s trained Llama.

Qwen2's decoder is Llama's with biases on q/k/v: the transplant copies every
language-model weight and sets those biases to 0; the rope base (10000) and
RMSNorm epsilon (1e-6) are the Llama's, and the M-RoPE sections (4, 6, 6)
split its head dimension (32), so on text-only positions (all three M-RoPE
components equal) the language model computes exactly what the Llama does.
The vision tower is `vllm_hs.models.tiny_vl`'s (seeded, depth 2, 14 px patches
merged 2x2) with ``out_hidden_size`` = 128, its merger scaled so that image
embeddings have the RMS of the language's word embeddings.
Transplanted, it answers text-only prompts as the structured target does
(the same greedy accuracy).

The tokenizer is the structured target's (1024 tokens) with
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
``<|video_pad|>`` appended (ids 1024-1027; their embeddings seeded, their
``lm_head`` rows 0) and `vllm_hs.models.tiny_vl`'s chat template (content
lists; an image part renders as the three vision tokens).

`image_conversations(n, split)` puts one seeded noise image (56 to 112 px a
side: 4 to 16 image tokens) before the text of each user turn of
`structured_target.conversations(n, split)`: the reply follows from the text,
so the image is context the target must read past. The transplanted model
does not: its greedy replies to held-out image prompts match the language on
about 37% of the tokens (96% without the image). So the build then trains
the language model (vision tower frozen) for ``tune_steps`` (300: about 20
seconds on 2 cores) on image prompts of the ``train`` language, images from
a seed stream of their own, and records the greedy token accuracy on the
held-out image prompts before and after (``structured_vl_target.json``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from vllm_hs.models.structured_target import (
    SPLIT_STREAMS,
    build_structured_target,
    conversations,
)
from vllm_hs.models.tiny import build_cached, normalize_tokenizer_config

__all__ = [
    "build_structured_vl_target",
    "conversation_image",
    "image_conversations",
    "vl_greedy_accuracy",
]

#: Bump when the files a build writes change for the same arguments.
FORMAT_VERSION = 1

IMAGE_SIDES = (56, 84, 112)


def build_structured_vl_target(
    *,
    seed: int = 0,
    steps: int = 1000,
    tune_steps: int = 300,
    cache_dir: Path | None = None,
) -> Path:
    """Build (or reuse from the cache) the structured VL target; its path."""
    args = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "steps": steps,
        "tune_steps": tune_steps,
    }
    return build_cached(
        "structured-vl",
        args,
        lambda out, a: _write(out, a, cache_dir),
        cache_dir,
    )


def conversation_image(split: str, index: int) -> Any:
    """The seeded image of conversation `index` of `split` (PIL)."""
    from vllm_hs.models.tiny_vl import seeded_image

    seed = SPLIT_STREAMS[split] * 1_000_003 + index
    rng = random.Random(seed * 31 + 7)
    return seeded_image(seed, rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES))


def image_conversations(
    n: int, split: str, image_dir: Path
) -> list[list[dict[str, Any]]]:
    """`structured_target.conversations(n, split)` with conversation i's image
    (written to ``image_dir/<split>-<i>.png``) as an OpenAI ``image_url`` part
    (``file://`` URL) before the text of the user turn."""
    image_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for i, conversation in enumerate(conversations(n, split)):
        path = (image_dir / f"{split}-{i}.png").resolve()
        if not path.is_file():
            conversation_image(split, i).save(path)
        user, *rest = conversation
        parts = [
            {"type": "image_url", "image_url": {"url": f"file://{path}"}},
            {"type": "text", "text": user["content"]},
        ]
        out.append([{"role": "user", "content": parts}, *rest])
    return out


def _write(out: Path, args: dict[str, Any], cache_dir: Path | None) -> None:
    import torch
    import transformers
    from safetensors.torch import load_file

    from vllm_hs.models import tiny_vl
    from vllm_hs.models.tiny import redraw_weights

    text_dir = build_structured_target(
        seed=args["seed"], steps=args["steps"], cache_dir=cache_dir
    )
    llama = json.loads((text_dir / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(text_dir)
    vision_tokens = [
        tiny_vl.VISION_START,
        tiny_vl.VISION_END,
        tiny_vl.IMAGE_TOKEN,
        tiny_vl.VIDEO_TOKEN,
    ]
    tokenizer.add_tokens(vision_tokens, special_tokens=True)
    tokenizer.chat_template = tiny_vl.VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in vision_tokens}
    text_vocab = llama["vocab_size"]
    if sorted(ids.values()) != list(range(text_vocab, text_vocab + 4)):
        raise RuntimeError(f"vision tokens got ids {ids}")
    hidden = llama["hidden_size"]
    head_dim = hidden // llama["num_attention_heads"]
    if head_dim != llama.get("head_dim", head_dim) or head_dim != 32:
        raise RuntimeError("the M-RoPE sections below need head_dim 32")
    rope = llama["rope_parameters"]
    special = {k: llama[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text_config = dict(
        vocab_size=text_vocab + len(vision_tokens),
        hidden_size=hidden,
        intermediate_size=llama["intermediate_size"],
        num_hidden_layers=llama["num_hidden_layers"],
        num_attention_heads=llama["num_attention_heads"],
        num_key_value_heads=llama["num_key_value_heads"],
        max_position_embeddings=2048,
        rms_norm_eps=llama["rms_norm_eps"],
        hidden_act=llama["hidden_act"],
        rope_parameters={
            "rope_type": "default",
            "mrope_section": [4, 6, 6],
            "rope_theta": rope["rope_theta"],
        },
        tie_word_embeddings=False,
        use_sliding_window=False,
        **special,
    )
    vision_config = tiny_vl.vision_config(out_hidden_size=hidden)
    config = transformers.Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids[tiny_vl.IMAGE_TOKEN],
        video_token_id=ids[tiny_vl.VIDEO_TOKEN],
        vision_start_token_id=ids[tiny_vl.VISION_START],
        vision_end_token_id=ids[tiny_vl.VISION_END],
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
        std=tiny_vl._weight_std,
    )
    state = model.state_dict()
    source = load_file(str(text_dir / "model.safetensors"))
    with torch.no_grad():
        for name, weight in source.items():
            target = (
                name
                if name == "lm_head.weight"
                else "model.language_model." + name.removeprefix("model.")
            )
            if target in ("lm_head.weight", "model.language_model.embed_tokens.weight"):
                state[target][:text_vocab] = weight
            else:
                state[target].copy_(weight)
        lm = model.model.language_model
        for layer in lm.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                         layer.self_attn.v_proj):  # fmt: skip
                proj.bias.zero_()
        words = source["model.embed_tokens.weight"]
        embed_rms = float(words.pow(2).mean().sqrt())
        gen = torch.Generator().manual_seed(args["seed"] * 7 + 3)
        lm.embed_tokens.weight[text_vocab:] = embed_rms * torch.randn(
            len(vision_tokens), hidden, generator=gen
        )
        model.lm_head.weight[text_vocab:] = 0
        # Image embeddings of the words' scale.
        merger = model.model.visual.merger.mlp[2]
        features = _image_features(
            model, [conversation_image("train", i) for i in range(8)]
        )
        scale = embed_rms / float(features.pow(2).mean().sqrt())
        merger.weight.mul_(scale)
        merger.bias.mul_(scale)
    image_only = vl_greedy_accuracy(None, 64, model=model, tokenizer=tokenizer)
    losses = _tune(model, tokenizer, args)
    model.config.dtype = torch.float32
    model.generation_config = transformers.GenerationConfig(**special)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tokenizer_config = out / "tokenizer_config.json"
    normalize_tokenizer_config(tokenizer_config)
    data = json.loads(tokenizer_config.read_text())
    data["processor_class"] = "Qwen2_5_VLProcessor"
    tokenizer_config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").write_text(tiny_vl.VL_CHAT_TEMPLATE)
    for name, kind in (
        ("preprocessor_config.json", "image"),
        ("video_preprocessor_config.json", "video"),
    ):
        (out / name).write_text(
            json.dumps(tiny_vl._processor_config(kind), indent=2, sort_keys=True) + "\n"
        )
    text_info = json.loads((text_dir / "structured_target.json").read_text())
    held_out = 64
    info = {
        "language_model": text_dir.name,
        "heldout_text_greedy_token_accuracy": text_info[
            "heldout_greedy_token_accuracy"
        ],
        "heldout_image_greedy_token_accuracy_before_tuning": image_only,
        "heldout_image_greedy_token_accuracy": vl_greedy_accuracy(
            out, held_out, model=model
        ),
        "tuning": {"steps": args["tune_steps"], "losses": losses},
        "heldout_prompts": held_out,
        "image_embedding_scale": scale,
    }
    (out / "structured_vl_target.json").write_text(json.dumps(info, indent=2) + "\n")


def _encode(
    tokenizer: Any, processor: Any, conversation: list[dict[str, Any]], image: Any
) -> tuple[list[int], list[int], dict[str, Any]]:
    """(expanded ids, assistant mask, vision inputs) of a text conversation
    with `image` before its user text."""
    user, reply = conversation
    messages = [
        {"role": "user", "content": [{"type": "image"},
                                     {"type": "text", "text": user["content"]}]},
        reply,
    ]  # fmt: skip
    full = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(full["input_ids"]), list(full["assistant_masks"])
    vision = processor(images=[image], return_tensors="pt")
    count = int(vision["image_grid_thw"].prod()) // processor.merge_size**2
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    at = ids.index(image_id)
    ids = ids[:at] + [image_id] * count + ids[at + 1 :]
    mask = mask[:at] + [0] * count + mask[at + 1 :]
    return ids, mask, vision


def _tune(model: Any, tokenizer: Any, args: dict[str, Any]) -> list[dict[str, float]]:
    """Train the language model (the vision tower frozen) on image prompts
    of the ``train`` language, with images from a stream of their own."""
    import math
    import time

    import torch

    from vllm_hs.models.structured_target import Language
    from vllm_hs.models.tiny_vl import seeded_image

    steps, batch_size = args["tune_steps"], 16
    if steps <= 0:
        return []
    language = Language.of(tokenizer)
    processor = _image_processor()
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    rng = random.Random(SPLIT_STREAMS["train"] * 7919 + args["seed"] + 1)
    pad = model.config.get_text_config().pad_token_id
    image_id = model.config.image_token_id
    losses = []
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        batch = []
        for _ in range(batch_size):
            image = seeded_image(
                rng.randrange(1 << 30), rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES)
            )
            batch.append(
                _encode(tokenizer, processor, language.conversation(rng), image)
            )
        length = max(len(ids) for ids, _, _ in batch)
        input_ids = torch.full((batch_size, length), pad)
        labels = torch.full((batch_size, length), -100)
        attention = torch.zeros(batch_size, length, dtype=torch.long)
        for row, (ids, mask, _) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor(
                [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            )
        loss = model(
            input_ids=input_ids,
            attention_mask=attention,
            labels=labels,
            pixel_values=torch.cat([v["pixel_values"] for _, _, v in batch]),
            image_grid_thw=torch.cat([v["image_grid_thw"] for _, _, v in batch]),
            mm_token_type_ids=(input_ids == image_id).long(),
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            losses.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return losses


def _image_features(model: Any, images: list[Any]) -> Any:
    """The vision tower's output (merged image embeddings) for `images`."""
    import torch

    processor = _image_processor()
    vision = processor(images=images, return_tensors="pt")
    out = model.model.get_image_features(
        vision["pixel_values"], vision["image_grid_thw"]
    )
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = torch.cat(list(features))
    return features


def _image_processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor,
    )

    from vllm_hs.models import tiny_vl

    config = tiny_vl._processor_config("image")
    keep = ("do_convert_rgb", "do_resize", "resample", "do_rescale",
            "rescale_factor", "do_normalize", "image_mean", "image_std",
            "size", "patch_size", "temporal_patch_size", "merge_size")  # fmt: skip
    return Qwen2VLImageProcessor(**{k: config[k] for k in keep})


def vl_greedy_accuracy(
    model_dir: Path | None, n: int, *, model: Any = None, tokenizer: Any = None
) -> float:
    """Share of reply tokens (``<|im_end|>`` included) that HF's greedy
    continuation gets right, position by position, over the first `n`
    held-out image prompts (`image_conversations`' images and text)."""
    import torch
    import transformers

    if tokenizer is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if model is None:
        model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir
        )
    model.eval()
    processor = _image_processor()
    image_id = model.config.image_token_id
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    correct = total = 0
    with torch.no_grad():
        for i, conversation in enumerate(conversations(n, "heldout")):
            user = [{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": conversation[0]["content"]}
            ]}]  # fmt: skip
            prompt = tokenizer.apply_chat_template(
                user, tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
            want = tokenizer(conversation[1]["content"])["input_ids"] + [end]
            vision = processor(
                images=[conversation_image("heldout", i)], return_tensors="pt"
            )
            count = int(vision["image_grid_thw"].prod()) // processor.merge_size**2
            at = prompt.index(image_id)
            ids = prompt[:at] + [image_id] * count + prompt[at + 1 :]
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                pixel_values=vision["pixel_values"],
                image_grid_thw=vision["image_grid_thw"],
                # Without them transformers falls back to 1-D positions.
                mm_token_type_ids=torch.tensor([[int(t == image_id) for t in ids]]),
                max_new_tokens=len(want),
                do_sample=False,
            )[0, len(ids) :].tolist()
            correct += sum(a == b for a, b in zip(out, want, strict=False))
            total += len(want)
    return correct / total
