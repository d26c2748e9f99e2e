"""The structured target (vllm_hs.models.structured_target): its language,
its token encoding (the chat template's, exactly), its splits, and a short
build that transformers loads. How well the full build learns the language is
recorded in its structured_target.json and measured by benchmarks.suites.acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_hs.models import structured_target as st  # noqa: E402
from vllm_hs.models.tiny import train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(st.TOKENIZER_SEED, st.VOCAB_SIZE)


@pytest.fixture(scope="module")
def language(tokenizer) -> st.Language:
    return st.Language.of(tokenizer)


def test_replies_follow_from_the_prompt(language: st.Language) -> None:
    alphabet = language.alphabet
    assert len(alphabet) == st.ALPHABET_SIZE == len(set(alphabet))
    for conversation in st.conversations(200, "train", language):
        words = conversation[0]["content"].split()
        reply = conversation[1]["content"].split()
        assert len(reply) == st.REPLY_WORDS
        if words[0] == st.COUNT_WORD:
            step = st.STEP_WORDS[words[1]]
            start = alphabet.index(words[2])
            expected = [
                alphabet[(start + step * i) % len(alphabet)]
                for i in range(1, st.REPLY_WORDS + 1)
            ]
        else:
            assert words[0] == st.REPEAT_WORD and 2 <= len(words) - 1 <= 6
            segment = words[1:]
            expected = [segment[i % len(segment)] for i in range(st.REPLY_WORDS)]
        assert reply == expected


def test_splits_are_seeded_and_disjoint(language: st.Language) -> None:
    train = st.conversations(300, "train", language)
    assert st.conversations(10, "train", language) == train[:10]
    heldout = st.conversations(100, "heldout", language)
    prompts = {c[0]["content"] for c in train}
    # Count prompts have 64 x 3 combinations, so some recur; repeat prompts
    # (64^2..64^6 segments) essentially never do.
    repeats = [c for c in heldout if c[0]["content"].split()[0] == st.REPEAT_WORD]
    assert repeats and not any(c[0]["content"] in prompts for c in repeats)
    with pytest.raises(ValueError):
        st.conversations(1, "test", language)


def test_encoder_is_the_chat_template(tokenizer, language: st.Language) -> None:
    encoder = st._Encoder(tokenizer)
    for conversation in st.conversations(20, "heldout", language):
        ids, mask = encoder.encode(conversation)
        full = tokenizer.apply_chat_template(
            conversation,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert ids == list(full["input_ids"])
        assert mask == list(full["assistant_masks"])
        prompt = tokenizer.apply_chat_template(
            conversation[:1],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
        )
        assert encoder.prompt(conversation) == list(prompt["input_ids"])


def test_short_build_loads_and_is_cached(tmp_path: Path) -> None:
    path = st.build_structured_target(steps=3, batch_size=4, cache_dir=tmp_path)
    assert st.build_structured_target(steps=3, batch_size=4, cache_dir=tmp_path) == path
    info = json.loads((path / "structured_target.json").read_text())
    assert info["training"]["steps"] == 3
    assert 0.0 <= info["heldout_greedy_token_accuracy"] <= 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 4 and not model.config.tie_word_embeddings
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
