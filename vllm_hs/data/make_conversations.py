"""Write `conversations.jsonl`: the small chat set `vllm-hs extract` uses when no
--data is given.

Deterministic (seeded `random.Random`, no other input): running it again writes
the same bytes. OpenAI ``messages`` form, one conversation per line: 300
conversations, about half single-turn, the rest with 2-3 assistant turns, some
with a system message. The text is built from templates and word lists (written
for this project), short enough that the whole set extracts in seconds on the
tiny model.

    python vllm_hs/data/make_conversations.py [OUTPUT]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20260101
NUM_CONVERSATIONS = 300

SUBJECTS = (
    "cat",
    "dog",
    "river",
    "city",
    "tree",
    "house",
    "garden",
    "train",
    "boat",
    "robot",
    "teacher",
    "farmer",
    "baker",
    "painter",
    "bird",
    "mountain",
    "lamp",
    "bridge",
    "library",
    "market",
    "kitchen",
    "forest",
    "island",
    "clock",
)
ADJECTIVES = (
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "new",
    "quiet",
    "busy",
    "bright",
    "dark",
    "tiny",
    "long",
    "happy",
    "tired",
    "clever",
    "gentle",
)
VERBS = (
    "walk",
    "wait",
    "sing",
    "work",
    "read",
    "look",
    "run",
    "sleep",
    "write",
    "listen",
    "play",
    "grow",
    "shine",
    "move",
    "rest",
)
PLACES = (
    "by the water",
    "in the city",
    "under the tree",
    "near the house",
    "at the market",
    "on the hill",
    "in the garden",
    "at night",
    "in the morning",
    "after the rain",
    "before dinner",
    "on the bridge",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer in short, clear sentences.",
    "You are a patient teacher who explains things simply.",
    "You are a storyteller. Keep every story short.",
    "You answer questions about numbers and colors.",
    "Be kind, be brief and be right.",
)
QUESTION_TEMPLATES = (
    "Tell me a short story about a {adj} {subj}.",
    "Why does the {subj} {verb} {place}?",
    "What is a good name for a {adj} {subj}?",
    "Can you write two sentences about the {subj} {place}?",
    "How many {subjs} can fit in a {adj} house?",
    "What color is the {subj}, and why?",
    "Please describe a {adj} {subj} in a few words.",
    "Is it true that every {subj} {verbs} {place}?",
    "Write a tiny poem about a {subj}.",
    "What would a {adj} {subj} say to a {subj2}?",
    "Explain to a child what a {subj} does all day.",
    "Give me three words that describe a {subj}.",
)
FOLLOW_UPS = (
    "Thanks! Can you make it shorter?",
    "Now tell me what happens next.",
    "Why is that?",
    "Can you say it again for a child?",
    "What about a {adj} {subj2}?",
    "Good. Give me one more example.",
    "And where does the {subj2} live?",
    "Please add a number to the answer.",
)
OPENERS = (
    "Sure.",
    "Of course.",
    "Here is one.",
    "Good question.",
    "Yes.",
    "Well,",
    "Let me think.",
    "Here you go.",
)
CLOSERS = (
    "I hope that helps.",
    "That is all for now.",
    "Ask me if you want more.",
    "The end.",
    "",
    "",
    "",
)


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + ("es" if noun.endswith(("ch", "s")) else "s")


def _verbs(rng: random.Random) -> str:
    verb = rng.choice(VERBS)
    return verb + ("es" if verb.endswith("h") else "s")


def _sentence(rng: random.Random) -> str:
    subj, subj2 = rng.choice(SUBJECTS), rng.choice(SUBJECTS)
    templates = (
        f"The {rng.choice(ADJECTIVES)} {subj} {_verbs(rng)} {rng.choice(PLACES)}.",
        f"A {subj} and a {subj2} {rng.choice(VERBS)} together.",
        f"Every day the {subj} {_verbs(rng)}, and the {subj2} {_verbs(rng)}.",
        f"It is {rng.choice(ADJECTIVES)}, like a {rng.choice(ADJECTIVES)} {subj2}.",
        f"There are {rng.randint(2, 12)} {_plural(subj)} {rng.choice(PLACES)}.",
        f"Nobody knows why the {subj} {_verbs(rng)} {rng.choice(PLACES)}.",
    )
    return rng.choice(templates)


def _answer(rng: random.Random) -> str:
    sentences = [_sentence(rng) for _ in range(rng.randint(1, 4))]
    parts = [rng.choice(OPENERS), *sentences, rng.choice(CLOSERS)]
    text = " ".join(p for p in parts if p)
    if rng.random() < 0.15:  # some answers span lines
        text = text.replace(". ", ".\n", 1)
    return text


def _fill(template: str, rng: random.Random) -> str:
    subj = rng.choice(SUBJECTS)
    return template.format(
        adj=rng.choice(ADJECTIVES),
        subj=subj,
        subjs=_plural(subj),
        subj2=rng.choice(SUBJECTS),
        verb=rng.choice(VERBS),
        verbs=_verbs(rng),
        place=rng.choice(PLACES),
    )


def make_conversations(seed: int = SEED, count: int = NUM_CONVERSATIONS) -> list[dict]:
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
        for turn in range(turns):
            template = rng.choice(QUESTION_TEMPLATES if turn == 0 else FOLLOW_UPS)
            messages.append({"role": "user", "content": _fill(template, rng)})
            messages.append({"role": "assistant", "content": _answer(rng)})
        conversations.append({"messages": messages})
    return conversations


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).with_name("conversations.jsonl")
    lines = [json.dumps(c, ensure_ascii=False) for c in make_conversations()]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} conversations to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
