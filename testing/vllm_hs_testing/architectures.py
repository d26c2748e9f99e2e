"""Tiny random models of the architectures the channel claims, for conformance.

`build_architecture_model(name)` writes a HuggingFace model directory (config,
safetensors; no tokenizer: engines run with ``skip_tokenizer_init``) from a
transformers config class built offline, with weights redrawn from a generator
keyed by (seed, parameter name) as in `vllm_hs.models.tiny`, so vLLM and HF load
the same weights and greedy outputs are varied. Directories are cached under
``<cache root>/models/arch-<name>-<hash>``.

`ARCHITECTURES` is the conformance table: every architecture of vLLM 0.32.0
that implements ``SupportsEagle3`` and that transformers can build offline,
plus those served by the generic capture (``generic=True``: no
``SupportsEagle3``; ``GENERIC_CAPTURE_MODELS`` in the series), with the dtype
vLLM's CPU backend runs them in. The "Architectures" table of
docs/architecture.md says what each check found and which architectures cannot
be checked here, and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hs.models.tiny import build_cached, param_seed

__all__ = ["ARCHITECTURES", "ArchSpec", "build_architecture_model"]

#: Bump when the files a build writes change for the same arguments.
FORMAT_VERSION = 1

WEIGHT_STD = 0.2
QK_STD = 0.1
NORM_NOISE_STD = 0.05
_QK_NAMES = ("q_proj", "k_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj")

_BASE: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "num_hidden_layers": 3,
}
_MOE: dict[str, Any] = {
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


@dataclass(frozen=True)
class ArchSpec:
    """One architecture of the conformance table."""

    config_class: str
    """transformers config class that builds it offline."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments on top of the shared tiny settings."""
    dtype: str = "float32"
    """The dtype vLLM's CPU backend runs it in."""
    fp32_tolerance: float | None = None
    """A looser float32 tolerance where vLLM's kernels differ from HF's
    (measured; still far below the ~0.3 error of a wrong row or layer)."""
    generic: bool = False
    """No SupportsEagle3 in vLLM: layers come from the generic capture of
    the residual stream (`vllm.v1.hidden_states.generic`)."""


#: name -> spec. Layer ids 0..L and "final_norm", prompt and output rows, are
#: checked against HF by tests/engine/test_architectures.py.
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaConfig"),
    "mistral": ArchSpec("MistralConfig", {"sliding_window": None}),
    "qwen2": ArchSpec("Qwen2Config"),
    "qwen3": ArchSpec("Qwen3Config"),
    "qwen3_moe": ArchSpec(
        "Qwen3MoeConfig", {**_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    ),
    "granite": ArchSpec(
        "GraniteConfig",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.1,
            "logits_scaling": 2.0,
        },
    ),
    "apertus": ArchSpec(
        "ApertusConfig",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        # vLLM's xIELU differs from HF's by ~9e-4 from layer 0 on (tokens equal).
        fp32_tolerance=3e-3,
    ),
    "gpt_oss": ArchSpec(
        "GptOssConfig",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
    # vLLM ties Cohere's LM head to the embeddings whatever the config says.
    "cohere2_moe": ArchSpec("Cohere2MoeConfig", {**_MOE, "tie_word_embeddings": True}),
    "afmoe": ArchSpec(
        "AfmoeConfig",
        # vLLM reads score_func/route_norm, which HF's config does not define.
        {
            **_MOE,
            "num_dense_layers": 1,
            "score_func": "sigmoid",
            "route_norm": True,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "gemma4": ArchSpec(
        "Gemma4TextConfig",
        {
            "global_head_dim": 64,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "hidden_size_per_layer_input": 0,
            "final_logit_softcapping": None,
        },
    ),
    # Hybrid: Mamba, attention and MLP blocks.
    "nemotron_h": ArchSpec(
        "NemotronHConfig",
        {
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "ssm_state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "mamba_chunk_size": 16,
            "expand": 1,
        },
    ),
    # MLA: the CPU backend needs a 576-wide latent cache (512 + 64) and bf16.
    "deepseek_v2": ArchSpec(
        "DeepseekV2Config",
        {
            "moe_intermediate_size": 64,
            "n_routed_experts": 4,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "head_dim": 64,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "rope_interleave": True,
        },
        dtype="bfloat16",
    ),
    # Without SupportsEagle3: generic capture.
    "mixtral": ArchSpec(
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        generic=True,
    ),
    # vLLM ties the Gemma family's LM head to the embeddings.
    "gemma": ArchSpec("GemmaConfig", {"tie_word_embeddings": True}, generic=True),
    "gemma2": ArchSpec(
        "Gemma2Config",
        {
            "sliding_window": 8,
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
        },
        generic=True,
    ),
    "gemma3": ArchSpec(
        "Gemma3TextConfig",
        {
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
        },
        generic=True,
    ),
    "gpt2": ArchSpec(
        "GPT2Config",
        {"n_embd": 128, "n_layer": 3, "n_head": 4, "n_positions": 512},
        generic=True,
    ),
}


def build_architecture_model(
    name: str, *, seed: int = 0, cache_dir: Path | None = None
) -> Path:
    """Build (or reuse from the cache) the tiny random model `name` of
    `ARCHITECTURES`; return its directory."""
    spec = ARCHITECTURES[name]
    args = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "seed": seed,
        "config_class": spec.config_class,
        "config": {**_BASE, **spec.config},
        "dtype": spec.dtype,
    }
    return build_cached(f"arch-{name}", args, _write_model, cache_dir)


def _write_model(out: Path, args: dict[str, Any]) -> None:
    import torch
    import transformers

    config = getattr(transformers, args["config_class"])(**args["config"])
    torch.manual_seed(args["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    _redraw_weights(model, args["seed"])
    dtype = getattr(torch, args["dtype"])
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(out)


def _redraw_weights(model: Any, seed: int) -> None:
    """Matrices N(0, 0.2) (q/k 0.1), biases N(0, 0.2), norm weights
    1 + N(0, 0.05); convolutions, SSM parameters and routing-correction biases
    keep their initialisation."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            low = name.lower()
            if "conv" in low or "dt_bias" in low or "correction" in low:
                continue
            gen = torch.Generator().manual_seed(param_seed(seed, name))
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            is_qk = any(q in low for q in _QK_NAMES)
            if param.dim() == 1 and "norm" in low and name.endswith("weight"):
                param.copy_(1.0 + noise * NORM_NOISE_STD)
            elif param.dim() >= 2 and name.endswith(
                ("weight", "gate_up_proj", "down_proj")
            ):
                param.copy_(noise * (QK_STD if is_qk else WEIGHT_STD))
            elif param.dim() == 1 and name.endswith("bias"):
                param.copy_(noise * (QK_STD if is_qk else WEIGHT_STD))
