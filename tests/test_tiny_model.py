"""Tests of vllm_hs.models.tiny: determinism, cache, archs/dtypes, tokenizer, chat."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_hs.models import tiny as tiny_model  # noqa: E402
from vllm_hs.models.tiny import (  # noqa: E402
    ARCHES,
    COMPLETE_MARKER,
    SPECIAL_TOKENS,
    build_tiny_model,
    tiny_model_info,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


def tree_digest(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "float32"), ("qwen2", "bfloat16")]
)
def test_build_is_deterministic(
    tmp_path_factory: pytest.TempPathFactory, arch: str, dtype: str
) -> None:
    first = build_tiny_model(arch, dtype, cache_dir=tmp_path_factory.mktemp("a"))
    second = build_tiny_model(arch, dtype, cache_dir=tmp_path_factory.mktemp("b"))
    assert first.name == second.name
    digest = tree_digest(first)
    assert digest == tree_digest(second)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(digest)


def test_seed_and_args_change_weights_and_directory(cache: Path) -> None:
    base = build_tiny_model(cache_dir=cache)
    other_seed = build_tiny_model(seed=1, cache_dir=cache)
    other_layers = build_tiny_model(num_hidden_layers=2, cache_dir=cache)
    assert len({base, other_seed, other_layers}) == 3
    weights = [
        hashlib.sha256((p / "model.safetensors").read_bytes()).digest()
        for p in (base, other_seed)
    ]
    assert weights[0] != weights[1]
    # The tokenizer depends on the seed too (its corpus is seeded).
    assert (base / "tokenizer.json").read_bytes() != (
        other_seed / "tokenizer.json"
    ).read_bytes()


def test_cache_layout_and_reuse(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = build_tiny_model("qwen3", "bfloat16", cache_dir=cache)
    assert path.parent == cache / "models"
    assert path.name.startswith("qwen3-bfloat16-")
    assert len(path.name.rsplit("-", 1)[1]) == 12
    assert (path / COMPLETE_MARKER).is_file()
    before = tree_digest(path)

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(tiny_model, "_write_model", no_rebuild)
    assert build_tiny_model("qwen3", "bfloat16", cache_dir=cache) == path
    assert tree_digest(path) == before
    # $VLLM_HS_CACHE is the default root.
    monkeypatch.setenv("VLLM_HS_CACHE", str(cache))
    assert build_tiny_model("qwen3", "bfloat16") == path
    monkeypatch.setenv("VLLM_HS_CACHE", str(tmp_path))
    with pytest.raises(AssertionError, match="rebuilt"):
        build_tiny_model("qwen3", "bfloat16")


def test_directory_without_marker_is_rebuilt(tmp_path: Path) -> None:
    path = build_tiny_model(cache_dir=tmp_path)
    digest = tree_digest(path)
    (path / COMPLETE_MARKER).unlink()
    (path / "model.safetensors").write_bytes(b"truncated")
    assert build_tiny_model(cache_dir=tmp_path) == path
    assert tree_digest(path) == digest
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]


def test_losing_a_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process publishes the same model while this one is building."""
    real_write = tiny_model._write_model
    winner: list[Path] = []

    def write_after_rival(out: Path, args: dict[str, object]) -> None:
        if not winner:
            monkeypatch.setattr(tiny_model, "_write_model", real_write)
            winner.append(build_tiny_model(cache_dir=tmp_path))  # the rival
            (winner[0] / "rival").write_text("first")
        real_write(out, args)

    monkeypatch.setattr(tiny_model, "_write_model", write_after_rival)
    path = build_tiny_model(cache_dir=tmp_path)
    assert path == winner[0]
    assert (path / "rival").read_text() == "first"  # not replaced
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(ARCHES))
def test_loads_in_transformers_with_config_dtype(
    cache: Path, arch: str, dtype: str
) -> None:
    path = build_tiny_model(arch, dtype, cache_dir=cache)
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == dtype
    assert config["architectures"] == [ARCHES[arch]]
    assert config["eos_token_id"] == 1
    assert (
        json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 1
    )
    assert tiny_model_info(path) == {
        "arch": arch,
        "dtype": dtype,
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "vocab_size": 1024,
    }

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert type(model).__name__ == ARCHES[arch]
    assert model.dtype == getattr(torch, dtype)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[17, 230, 451, 88, 600]]),
            do_sample=False,
            max_new_tokens=20,
            eos_token_id=None,
        )
    new = out[0, 5:].tolist()
    assert len(new) == 20
    assert len(set(new)) > 3, new


def test_norm_weights_near_one_other_weights_wide(cache: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(
        build_tiny_model("qwen3", cache_dir=cache) / "model.safetensors"
    )
    norms = [k for k in weights if k.endswith("norm.weight")]
    assert any("q_norm" in k for k in norms)
    for key in norms:
        assert (weights[key] - 1).abs().max() < 0.3, key
        assert weights[key].std() > 0.01, key
    std = weights["model.layers.0.mlp.down_proj.weight"].std().item()
    assert std == pytest.approx(tiny_model.WEIGHT_STD, rel=0.05)
    std = weights["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert std == pytest.approx(tiny_model.QK_STD, rel=0.05)


@pytest.fixture(scope="module")
def tokenizer(cache: Path) -> object:
    return transformers.AutoTokenizer.from_pretrained(build_tiny_model(cache_dir=cache))


def test_tokenizer_vocab_and_special_tokens(tokenizer: object) -> None:
    assert len(tokenizer) == 1024
    assert tokenizer.is_fast
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    assert ids == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        0,
        1,
        2,
    )
    text = "Hello there, tell me a small story about 42 blue cats!"
    encoded = tokenizer(text)["input_ids"]
    assert all(i >= len(SPECIAL_TOKENS) for i in encoded)  # no BOS/EOS added
    assert len(encoded) < len(text) / 2  # merges were learned
    assert tokenizer.decode(encoded) == text


MESSAGES = [
    {"role": "system", "content": "You are a tiny model."},
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "I am the first answer."},
    {"role": "user", "content": "Good."},
    {"role": "assistant", "content": " Then 42!"},
    {"role": "user", "content": "More?"},
    {"role": "assistant", "content": "\n\nYes:\n"},
]


def test_chat_template_renders_chatml(tokenizer: object) -> None:
    text = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a tiny model.<|im_end|>\n"
        "<|im_start|>user\nHello, who are you?<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        MESSAGES[:2], tokenize=False, add_generation_prompt=True
    )
    assert prompt == text + "<|im_start|>assistant\n"
    full = tokenizer.apply_chat_template(MESSAGES[:3], tokenize=False)
    assert full == text + "<|im_start|>assistant\nI am the first answer.<|im_end|>\n"


def test_assistant_mask_covers_content_and_im_end(tokenizer: object) -> None:
    out = tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            spans.append((i, i))
        if m:
            spans[-1] = (spans[-1][0], i + 1)
    assistant = [m["content"] for m in MESSAGES if m["role"] == "assistant"]
    assert len(spans) == len(assistant)
    newline = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))
    for (start, end), content in zip(spans, assistant, strict=True):
        assert tokenizer.decode(ids[start:end]) == content + "<|im_end|>"
        assert ids[end - 1] == 4  # <|im_end|> is masked
        assert ids[end : end + 1] == newline  # the "\n" after it is not
        assert tokenizer.decode(ids[:start]).endswith("<|im_start|>assistant\n")
    # Nothing else is masked: the system and user turns are 0.
    assert sum(mask) == sum(end - start for start, end in spans)


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        build_tiny_model("mistral", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_tiny_model("llama", "float16", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(head_dim=16, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        build_tiny_model(
            num_attention_heads=4, num_key_value_heads=3, cache_dir=tmp_path
        )
    assert not (tmp_path / "models").exists()
