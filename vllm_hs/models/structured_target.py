"""A tiny target model that speaks a structured language, so that a draft
model can learn to predict it on prompts it never saw.

The random-weight tiny models (`vllm_hs.models.tiny`) continue any prompt with
noise: a draft can only memorise them. This target is trained (seeded, on
CPU, in about three minutes on 2 cores) on chat conversations of a synthetic
language whose replies follow from the prompt:

* **count**: ``"number <step> <word>"`` -> the words after ``<word>`` in a
  fixed 64-word alphabet, ``<step>`` apart (``one``/``two``/``big`` = 1, 2,
  3), wrapping around: ``"number two cat"`` -> ``" city come could ..."``.
* **repeat**: ``"back <w1> ... <wk>"`` (k = 2..6 words) -> the segment again
  and again.

Replies are `REPLY_WORDS` words, then ``<|im_end|>``. Every word is one token
of the tiny tokenizer (the same byte-level BPE as `vllm_hs.models.tiny`, with
its special tokens and ChatML template), so a conversation is tokenised
exactly as the chat template renders it. `conversations(n, split)` draws
seeded conversations; the ``train`` and ``heldout`` splits come from disjoint
seed streams (held-out prompts are new combinations of start word, step and
segment, not seen in training).

`build_structured_target()` trains a 4-layer Llama (hidden 128) on
``train`` conversations, loss on the assistant tokens only, and writes a
HuggingFace directory (float32) that vLLM and transformers load offline, with
``structured_target.json`` (the language, the training losses and the greedy
token accuracy on held-out prompts). Built once per arguments and cached under
``<cache root>/models/structured-<hash>``.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hs.models.tiny import build_cached

__all__ = [
    "REPLY_WORDS",
    "Language",
    "build_structured_target",
    "conversations",
    "greedy_accuracy",
]

#: Bump when the files a build writes change for the same arguments.
FORMAT_VERSION = 1

REPLY_WORDS = 24
ALPHABET_SIZE = 64
STEP_WORDS = {"one": 1, "two": 2, "big": 3}
COUNT_WORD = "number"
REPEAT_WORD = "back"
#: Seed streams of the two splits (a conversation's rng is seeded by
#: (stream, index)).
SPLIT_STREAMS = {"train": 1, "heldout": 2}
VOCAB_SIZE = 1024
TOKENIZER_SEED = 0


@dataclass(frozen=True)
class Language:
    """The alphabet and command words, as tokens of the tiny tokenizer."""

    alphabet: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> Language:
        """The first `ALPHABET_SIZE` lowercase words (3-6 letters) that are
        one token with a leading space, commands excluded, in sorted order."""
        vocab = tokenizer.get_vocab()
        commands = {COUNT_WORD, REPEAT_WORD, *STEP_WORDS}
        words = sorted(
            token[1:]
            for token in vocab
            if token.startswith("Ġ")
            and token[1:].isalpha()
            and token[1:].islower()
            and 3 <= len(token) - 1 <= 6
        )
        single = {w for w in words if _one_token(tokenizer, w)}
        missing = sorted(commands - single)
        if missing:
            raise RuntimeError(f"command words are not single tokens: {missing}")
        alphabet = tuple(w for w in words if w in single and w not in commands)
        if len(alphabet) < ALPHABET_SIZE:
            raise RuntimeError(f"only {len(alphabet)} single-token words")
        return cls(alphabet[:ALPHABET_SIZE])

    def conversation(self, rng: random.Random) -> list[dict[str, str]]:
        """One seeded conversation: the user's prompt and the reply."""
        n = len(self.alphabet)
        if rng.random() < 0.5:
            step_word = rng.choice(sorted(STEP_WORDS))
            step = STEP_WORDS[step_word]
            start = rng.randrange(n)
            prompt = f"{COUNT_WORD} {step_word} {self.alphabet[start]}"
            reply = [
                self.alphabet[(start + step * (i + 1)) % n] for i in range(REPLY_WORDS)
            ]
        else:
            segment = [rng.choice(self.alphabet) for _ in range(rng.randint(2, 6))]
            prompt = f"{REPEAT_WORD} " + " ".join(segment)
            reply = [segment[i % len(segment)] for i in range(REPLY_WORDS)]
        # Words with a leading space: each is then one token.
        return [
            {"role": "user", "content": " " + prompt},
            {"role": "assistant", "content": " " + " ".join(reply)},
        ]


def _one_token(tokenizer: Any, word: str) -> bool:
    return len(tokenizer(" " + word)["input_ids"]) == 1


def conversations(
    n: int, split: str = "train", language: Language | None = None
) -> list[list[dict[str, str]]]:
    """The first `n` conversations of a split (the same for any `n`)."""
    if split not in SPLIT_STREAMS:
        raise ValueError(f"split must be one of {sorted(SPLIT_STREAMS)}")
    language = language or _default_language()
    stream = SPLIT_STREAMS[split]
    return [
        language.conversation(random.Random(stream * 1_000_003 + i)) for i in range(n)
    ]


def _default_language() -> Language:
    from vllm_hs.models.tiny import train_tokenizer

    return Language.of(train_tokenizer(TOKENIZER_SEED, VOCAB_SIZE))


def build_structured_target(
    *,
    seed: int = 0,
    steps: int = 1000,
    batch_size: int = 32,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    learning_rate: float = 3e-3,
    cache_dir: Path | None = None,
) -> Path:
    """Train (or reuse from the cache) the structured target; its directory."""
    args = {
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "learning_rate": learning_rate,
    }
    return build_cached("structured", args, _write_target, cache_dir)


class _Encoder:
    """Conversations -> token ids and assistant masks, without the chat
    template's cost per conversation: every word is one token, so a
    conversation is the template's fixed pieces around the words' ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        probe = [
            {"role": "user", "content": " " + COUNT_WORD},
            {"role": "assistant", "content": " " + REPEAT_WORD},
        ]
        full = tokenizer.apply_chat_template(
            probe, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(full["input_ids"]), list(full["assistant_masks"])
        user_id = tokenizer.convert_tokens_to_ids("Ġ" + COUNT_WORD)
        reply_id = tokenizer.convert_tokens_to_ids("Ġ" + REPEAT_WORD)
        u, r = ids.index(user_id), ids.index(reply_id)
        self.head, self.middle, self.tail = ids[:u], ids[u + 1 : r], ids[r + 1 :]
        self.tail_mask = mask[r + 1 :]
        self._ids: dict[str, int] = {}

    def _word_ids(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            key = "Ġ" + word
            if key not in self._ids:
                self._ids[key] = self.tokenizer.convert_tokens_to_ids(key)
            out.append(self._ids[key])
        return out

    def prompt(self, conversation: list[dict[str, str]]) -> list[int]:
        """The generation prompt (the user turn, then the assistant header)."""
        user = self._word_ids(conversation[0]["content"])
        return self.head + user + self.middle

    def encode(self, conversation: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        prompt = self.prompt(conversation)
        reply = self._word_ids(conversation[1]["content"])
        ids = prompt + reply + self.tail
        mask = [0] * len(prompt) + [1] * len(reply) + self.tail_mask
        return ids, mask


def _write_target(out: Path, args: dict[str, Any]) -> None:
    import torch
    import transformers

    from vllm_hs.models.tiny import (
        SPECIAL_TOKENS,
        normalize_tokenizer_config,
        train_tokenizer,
    )

    tokenizer = train_tokenizer(TOKENIZER_SEED, VOCAB_SIZE)
    language = Language.of(tokenizer)
    encoder = _Encoder(tokenizer)
    bos_id, eos_id, pad_id = (
        tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[:3]
    )
    hidden = args["hidden_size"]
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=args["num_hidden_layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(args["seed"])
    model = transformers.LlamaForCausalLM(config)
    losses = _train(model, language, encoder, args, pad_id)
    accuracy = greedy_accuracy(model, encoder, conversations(64, "heldout", language))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.config.dtype = torch.float32
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    normalize_tokenizer_config(out / "tokenizer_config.json")
    info = {
        "language": {
            "alphabet": list(language.alphabet),
            "count_word": COUNT_WORD,
            "repeat_word": REPEAT_WORD,
            "step_words": STEP_WORDS,
            "reply_words": REPLY_WORDS,
        },
        "training": {**args, "losses": losses},
        "heldout_greedy_token_accuracy": accuracy,
    }
    (out / "structured_target.json").write_text(json.dumps(info, indent=2) + "\n")


def _train(
    model: Any,
    language: Language,
    encoder: _Encoder,
    args: dict[str, Any],
    pad_id: int,
) -> list[dict[str, float]]:
    import torch

    steps, batch_size = args["steps"], args["batch_size"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args["learning_rate"],
        weight_decay=0.01,
        betas=(0.9, 0.98),
    )
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    rng = random.Random(SPLIT_STREAMS["train"] * 7919 + args["seed"])
    losses = []
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        batch = [encoder.encode(language.conversation(rng)) for _ in range(batch_size)]
        length = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, length), pad_id)
        labels = torch.full((batch_size, length), -100)
        attention = torch.zeros(batch_size, length, dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor(
                [t if m else -100 for t, m in zip(ids, mask, strict=True)]
            )
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
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
    return losses


def greedy_accuracy(
    model: Any, encoder: _Encoder, held_out: list[list[dict[str, str]]]
) -> float:
    """Share of reply tokens (``<|im_end|>`` included) that the model's greedy
    continuation of each prompt gets right, position by position."""
    import torch

    correct = total = 0
    with torch.no_grad():
        for conversation in held_out:
            prompt = encoder.prompt(conversation)
            want = encoder.encode(conversation)[0][len(prompt) :]
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=len(want),
                do_sample=False,
            )[0, len(prompt) :].tolist()
            correct += sum(a == b for a, b in zip(out, want, strict=False))
            total += len(want)
    return correct / total
