"""Tiny, seeded, offline test models (Llama / Qwen2 / Qwen3) with a real tokenizer.

`build_tiny_model` writes a HuggingFace model directory (``config.json``,
``generation_config.json``, ``model.safetensors``, tokenizer files) that both
transformers and vLLM load without any network access, and returns its path.

Conventions:

* **Determinism.** Same arguments => byte-identical files (for one torch /
  transformers / tokenizers version). Every parameter is redrawn from a
  ``torch.Generator`` seeded from ``(seed, parameter name)``, in float32, then cast
  to the requested dtype. Matrices, embeddings and biases are drawn from
  ``N(0, WEIGHT_STD)``, except ``q_proj``/``k_proj`` (weights and biases) from
  ``N(0, QK_STD)``; RMSNorm weights are ``1 + N(0, NORM_NOISE_STD)``. Default
  transformers init gives near-uniform logits (greedy output collapses to one
  token); these larger weights give varied greedy output. With q/k at 0.2 too,
  attention logits have RMS ~5 (near-argmax softmax) and bf16 rounding changes
  whole rows of the deeper states by up to ~30% (vs fp32 compute), which no
  tolerance can tell from a wrong row; at 0.1 (logit RMS ~1.3, like Qwen3's
  normalized q/k) that drops to ~7% while attention still depends on content
  and relative position.
* **Dtype.** ``config.json`` carries the requested dtype (``"dtype"``), so vLLM's
  ``dtype="auto"`` and ``from_pretrained(dtype="auto")`` pick it.
  ``tie_word_embeddings`` is false: ``lm_head`` has its own weights.
* **Tokenizer.** Byte-level BPE trained by ``tokenizers`` on a synthetic, seeded,
  English-like corpus generated in code; exactly ``vocab_size`` entries, special
  tokens first: ``<|bos|>``=0, ``<|eos|>``=1, ``<|pad|>``=2, ``<|im_start|>``=3,
  ``<|im_end|>``=4. Plain ``tokenizer(text)`` adds no BOS/EOS. ``eos_token_id`` (1)
  is in ``config.json`` and ``generation_config.json``.
* **Chat template.** ChatML: each message renders as
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; ``add_generation_prompt=True``
  appends ``<|im_start|>assistant\\n``. Assistant turns wrap
  ``{content}<|im_end|>`` in ``{% generation %}``, so
  ``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``
  returns ``assistant_masks`` = 1 exactly on the tokens of each assistant
  message's content plus its closing ``<|im_end|>``; the ``<|im_start|>assistant\\n``
  header and the ``\\n`` after ``<|im_end|>`` are 0 (transformers marks a token
  when its first character lies inside the span; the corpus has no newlines, so
  no merge contains ``\\n`` and the header's ``\\n`` is always its own token,
  even when the content starts with newlines).
  See `ASSISTANT_MASK_DOC`.
* **Cache.** ``<root>/models/<arch>-<dtype>-<hash>``, root = ``cache_dir`` or
  vllm-hs's cache (`vllm_hs.fs.cache_root`); hash = first 12 hex digits of the
  SHA-256 of all arguments and `FORMAT_VERSION`. A directory counts as complete
  only when it holds `COMPLETE_MARKER`. Builds go to a temporary sibling and are
  published with one ``os.rename`` (`vllm_hs.fs.publish_dir`); when two processes
  race, the loser discards its copy and returns the winner's.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_hs import fs
from vllm_hs.fs import publish_dir, staging_dir

__all__ = [
    "ARCHES",
    "ASSISTANT_MASK_DOC",
    "CHAT_TEMPLATE",
    "COMPLETE_MARKER",
    "DTYPES",
    "FORMAT_VERSION",
    "SPECIAL_TOKENS",
    "build_cached",
    "build_tiny_model",
    "cache_root",
    "normalize_tokenizer_config",
    "param_seed",
    "redraw_weights",
    "seeded_prompt",
    "tiny_model_info",
    "train_tokenizer",
]

#: Bump when the files a build writes change for the same arguments.
FORMAT_VERSION = 1

#: File written last into a build; its presence marks a complete model directory.
COMPLETE_MARKER = ".vllm-hs-complete"

#: arch name -> transformers architecture class name.
ARCHES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

DTYPES: tuple[str, ...] = ("float32", "bfloat16")

#: Special tokens, in id order (ids 0..4).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
)
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END = SPECIAL_TOKENS

#: Head sizes vLLM's CPU attention backend accepts (16 fails).
CPU_ATTENTION_HEAD_SIZES = frozenset(
    {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}
)

WEIGHT_STD = 0.2
QK_STD = 0.1
NORM_NOISE_STD = 0.05

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

ASSISTANT_MASK_DOC = (
    "assistant_masks is 1 on every token of an assistant message's content and on "
    "its closing <|im_end|>; 0 on the '<|im_start|>assistant\\n' header, on the "
    "'\\n' after <|im_end|>, and on all non-assistant messages and the generation "
    "prompt."
)

# Words for the synthetic corpus: common English plus the chat role names, so the
# role headers and ordinary text tokenize into a few tokens each.
_WORDS = (
    "the a of and to in is was he she it they we you that this with for on at by "
    "from as be have had not but or an are were his her their our one all would "
    "there what so up out if about who get which go me when make can like time no "
    "just him know take people into year your good some could them see other than "
    "then now look only come its over think also back after use two how work first "
    "well way even new want because any these give day most us hello hi thanks "
    "please yes sure question answer system user assistant model tell write small "
    "story tiny test number red blue green cat dog house tree water light city "
    "river name why where very much many more little long great old right big high"
).split()
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s")
_ONSETS += ("t", "v", "w", "z", "br", "cr", "dr", "st", "tr", "pl", "sh", "ch", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "oo", "ie")
_CODAS = ("", "n", "r", "s", "t", "l", "m", "ng", "nd", "st", "ck")
_PUNCT = (".", ".", ".", "?", "!", ",", ";", ":")


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """The cache root: `cache_dir`, else vllm-hs's (`vllm_hs.fs.cache_root`)."""
    return Path(cache_dir) if cache_dir is not None else fs.cache_root()


def build_tiny_model(
    arch: str = "llama",
    dtype: str = "float32",
    *,
    seed: int = 0,
    num_hidden_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 1024,
    max_position_embeddings: int = 1024,
    cache_dir: Path | None = None,
) -> Path:
    """Build (or reuse from the cache) a tiny seeded model directory; return its path.

    ``arch`` is one of `ARCHES` (``llama``, ``qwen2``, ``qwen3``), ``dtype`` one of
    `DTYPES`. ``head_dim`` must be a size vLLM's CPU attention supports (>= 32).
    See the module docstring for weights, tokenizer, chat template and cache layout.
    """
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {sorted(ARCHES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(
            f"head_dim must be one of {sorted(CPU_ATTENTION_HEAD_SIZES)} "
            f"(vLLM CPU attention), got {head_dim}"
        )
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    min_vocab = 256 + len(SPECIAL_TOKENS) + 1
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab}, got {vocab_size}")
    for name, value in (
        ("num_hidden_layers", num_hidden_layers),
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

    args: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "dtype": dtype,
        "seed": seed,
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
    }
    return build_cached(f"{arch}-{dtype}", args, _write_model, cache_dir)


def build_cached(
    prefix: str,
    args: dict[str, Any],
    write: Callable[[Path, dict[str, Any]], None],
    cache_dir: Path | None = None,
) -> Path:
    """``<cache root>/models/<prefix>-<hash of args>``, written by
    ``write(directory, args)`` unless a complete build is already there (see
    the module docstring: marker file, atomic publish, races)."""
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()
    models_dir = cache_root(cache_dir) / "models"
    final = models_dir / f"{prefix}-{digest[:12]}"
    if (final / COMPLETE_MARKER).is_file():
        return final
    with staging_dir(models_dir, final.name) as tmp:
        write(tmp, args)
        (tmp / COMPLETE_MARKER).write_text(json.dumps(args, sort_keys=True) + "\n")
        publish_dir(tmp, final, complete=COMPLETE_MARKER)
    return final


def _write_model(out: Path, args: dict[str, Any]) -> None:
    import torch
    import transformers

    vocab_size = args["vocab_size"]
    tokenizer = train_tokenizer(args["seed"], vocab_size)
    bos_id, eos_id, pad_id = (
        tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[:3]
    )

    arch_cls = getattr(transformers, ARCHES[args["arch"]])
    config_cls = arch_cls.config_class
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_hidden_layers"],
        num_attention_heads=args["num_attention_heads"],
        num_key_value_heads=args["num_key_value_heads"],
        head_dim=args["head_dim"],
        max_position_embeddings=args["max_position_embeddings"],
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch_dtype = getattr(torch, args["dtype"])
    torch.manual_seed(args["seed"])
    model = arch_cls(config)
    redraw_weights(model, args["seed"])
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    normalize_tokenizer_config(out / "tokenizer_config.json")

    config_json = json.loads((out / "config.json").read_text())
    if config_json.get("dtype", config_json.get("torch_dtype")) != args["dtype"]:
        raise RuntimeError(f"config.json dtype is not {args['dtype']}: {config_json}")


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def redraw_weights(
    model: Any,
    seed: int,
    *,
    norm_modules: tuple[str, ...] = (),
    qk_modules: tuple[str, ...] = ("q_proj", "k_proj"),
    std: Callable[[str, Any], float | None] | None = None,
) -> None:
    """Redraw every parameter in float32 from a generator keyed by (seed, name):
    norms (modules named ``*norm*`` or in `norm_modules`) ``1 + N(0,
    NORM_NOISE_STD)``, `qk_modules` ``N(0, QK_STD)``, the rest ``N(0,
    WEIGHT_STD)``; ``std(name, param)``, when given and not None, overrides the
    standard deviation of a parameter."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
            module_name = name.rsplit(".", 2)[-2] if name.count(".") else ""
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            override = std(name, param) if std is not None else None
            if override is not None:
                value = override * noise
            elif "norm" in module_name or module_name in norm_modules:
                value = 1.0 + NORM_NOISE_STD * noise
            elif module_name in qk_modules:
                value = QK_STD * noise
            else:
                value = WEIGHT_STD * noise
            param.copy_(value.to(param.dtype))


def _synthetic_corpus(seed: int, num_lines: int) -> list[str]:
    """A seeded, English-like corpus: common words, pseudo-words, numbers."""
    rng = random.Random(seed)

    def pseudo_word() -> str:
        return "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.randint(1, 3))
        )

    lines = []
    for _ in range(num_lines):
        words = [
            rng.choice(_WORDS) if rng.random() < 0.7 else pseudo_word()
            for _ in range(rng.randint(3, 14))
        ]
        line = " ".join(words).capitalize()
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 99999)}"
        lines.append(line + rng.choice(_PUNCT))
    return lines


def train_tokenizer(
    seed: int,
    vocab_size: int,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """Train a byte-level BPE tokenizer with exactly `vocab_size` entries;
    `special_tokens` take the first ids, in order (they must start with
    `SPECIAL_TOKENS`)."""
    if special_tokens[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
        raise ValueError(f"special_tokens must start with {SPECIAL_TOKENS}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = _synthetic_corpus(seed, max(2000, 4 * vocab_size))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the synthetic corpus yields {tok.get_vocab_size()} tokens, not "
            f"vocab_size={vocab_size}; use a smaller vocab_size"
        )
    for i, token in enumerate(special_tokens):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token} is not id {i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(special_tokens[3:]),
        chat_template=chat_template,
    )


def normalize_tokenizer_config(path: Path) -> None:
    """Name the class ``PreTrainedTokenizerFast`` (transformers 5 writes its alias
    ``TokenizersBackend``); both load it, the former also in older versions."""
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tiny_model_info(path: Path | str) -> dict[str, Any]:
    """Read ``config.json`` of a model directory.

    Returns ``{"arch", "dtype", "num_hidden_layers", "hidden_size", "vocab_size"}``;
    ``arch`` is the `ARCHES` key of the architecture (or the class name if unknown),
    ``dtype`` the string in config.json (``dtype`` or legacy ``torch_dtype``).
    """
    config = json.loads((Path(path) / "config.json").read_text())
    arch_cls = (config.get("architectures") or [""])[0]
    by_cls = {cls: name for name, cls in ARCHES.items()}
    return {
        "arch": by_cls.get(arch_cls, arch_cls),
        "dtype": config.get("dtype", config.get("torch_dtype")),
        "num_hidden_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
    }


def seeded_prompt(seed: int, length: int, vocab: int = 1024, low: int = 8) -> list[int]:
    """Deterministic token ids in [low, vocab) (below `low`: special tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (length,), generator=g).tolist()
