"""32 requests in flight at once, mixed, every one right against HF."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.server import (
    Collected,
    Want,
    check,
    collect_response,
    collect_stream,
)

# (hidden_states of the request, what it asked for)
VARIANTS: list[tuple[dict[str, Any] | None, Want | None]] = [
    ({}, Want()),
    (None, None),
    ({"layers": ["final_norm", 2]}, Want(["final_norm", 2])),
    ({"layers": [-1], "prompt": False}, Want([-1], prompt=False)),
    ({"layers": [0, 2], "output": False}, Want([0, 2], output=False)),
    ({"layers": [2], "encoding": "float"}, Want([2])),
    ({"layers": [4, 0, "final_norm"]}, Want([4, 0, "final_norm"])),
]

SHARED = seeded_prompt(500, 150)  # long common prefix: prefix-cache hits


@dataclass
class Case:
    chat: bool
    stream: bool
    hidden_states: dict[str, Any] | None
    want: Want | None
    max_tokens: int
    prompt: list[int] | None = None
    messages: list[dict[str, str]] | None = None


def make_cases() -> list[Case]:
    cases = []
    for i in range(32):
        hs, want = VARIANTS[i % len(VARIANTS)]
        chat = i % 4 == 3
        case = Case(
            chat,
            stream=(i // 2) % 2 == 1,
            hidden_states=hs,
            want=want,
            max_tokens=2 + i % 7,
        )
        if chat:
            words = " ".join(["the red cat"] * (1 + (i * 7) % 25))
            case.messages = [{"role": "user", "content": f"{i}: {words}"}]
        elif i % 5 == 0:
            case.prompt = SHARED[: 130 + i % 20]
        else:
            case.prompt = seeded_prompt(600 + i, 3 + (i * 37) % 150)
        cases.append(case)
    return cases


def run(oai: Any, model: str, case: Case) -> Collected:
    extra: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True}
    if case.hidden_states is not None:
        extra["hidden_states"] = case.hidden_states
    common = dict(
        model=model,
        max_tokens=case.max_tokens,
        temperature=0.0,
        stream=case.stream,
        extra_body=extra,
    )
    if case.chat:
        response = oai.chat.completions.create(messages=case.messages, **common)
    else:
        response = oai.completions.create(prompt=case.prompt, **common)
    if case.stream:
        return collect_stream(response, chat=case.chat)
    return collect_response(response, chat=case.chat)


def test_32_concurrent_mixed(oai, served_model, model_dir):
    cases = make_cases()
    assert len(cases) == 32
    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = [pool.submit(run, oai, served_model, case) for case in cases]
        results = [future.result(timeout=300) for future in futures]
    for i, (case, got) in enumerate(zip(cases, results, strict=True)):
        what = (
            f"request {i} ({'chat' if case.chat else 'completion'}, "
            f"{'stream' if case.stream else 'full'}, {case.hidden_states})"
        )
        if case.prompt is not None:
            assert got.prompt_ids[0] == case.prompt, what
        assert len(got.token_ids[0]) == case.max_tokens, what
        check(model_dir, got, case.want, what, stream=case.stream)
