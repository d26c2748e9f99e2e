"""Real model shapes for benchmarks on a GPU: a model directory with a real
model's config.json (no weights: run it with ``--load-format dummy``) and the
embedded tiny model's tokenizer (benchmark prompts are token ids; vLLM accepts
ids below the model's vocab size).

    python -m benchmarks.model_shapes llama-3.1-8b DEST

Shapes are copied from the public config.json files; bos/eos are the tiny
tokenizer's, so that generation stops the same way on every shape.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B (config.json, transformers' Llama config).
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "vocab_size": 128256,
    },
}

# Files of the tiny model a shape directory takes (everything but weights and
# the configs).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_shape(name: str, dest: Path) -> Path:
    """Write `dest/config.json` of shape `name` with the tiny model's tokenizer."""
    from vllm_hs.models.tiny import build_tiny_model

    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    tiny = build_tiny_model("llama", "bfloat16")
    tiny_config = json.loads((tiny / "config.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for file in _TOKENIZER_FILES:
        if (tiny / file).is_file():
            shutil.copyfile(tiny / file, dest / file)
    ids = {key: tiny_config[key] for key in ("bos_token_id", "eos_token_id")}
    config = {**SHAPES[name], **ids}
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    print(write_shape(args.shape, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
