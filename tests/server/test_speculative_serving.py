"""The OpenAI server with ngram speculative decoding on: full and streamed
completions carry rows of accepted tokens only, every row against HF on the
final sequence, greedy tokens equal HF's; drafts were proposed, accepted and
rejected while serving them."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_hs.hf_reference import hf_greedy
from vllm_hs_testing.requests import repeated_prompt
from vllm_hs_testing.server import Want, check, collect_response, collect_stream


@pytest.fixture(scope="module")
def spec_oai(spec_server):
    import openai

    client = openai.OpenAI(
        base_url=spec_server.base_url, api_key="x", timeout=120.0, max_retries=0
    )
    yield client
    client.close()


def test_rows_under_speculation(spec_server, spec_oai: Any, model_dir):
    drafts = spec_server.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = spec_server.metric("vllm:spec_decode_num_accepted_tokens_total")
    cases = [({}, Want()), ({"prompt": False, "layers": [2, 0]}, Want([2, 0], False))]
    for stream in (False, True):
        for i, (hs, want) in enumerate(cases):
            # The model's own greedy continuation ends the prompt: where the
            # tiny model loops, ngram drafts are accepted.
            base = repeated_prompt(500 + i + 10 * stream, 24, 5 + i)
            prompt = base + hf_greedy(model_dir, base, 40)
            response = spec_oai.completions.create(
                model=model_dir,
                prompt=prompt,
                max_tokens=30,
                temperature=0.0,
                stream=stream,
                extra_body={
                    "return_token_ids": True,
                    "ignore_eos": True,
                    "hidden_states": hs,
                },
            )
            got = (
                collect_stream(response, chat=False)
                if stream
                else collect_response(response, chat=False)
            )
            what = f"spec {i} {'stream' if stream else 'full'}"
            assert got.token_ids[0] == hf_greedy(model_dir, prompt, 30), what
            check(model_dir, got, want, what, stream=stream)
    drafts = spec_server.metric("vllm:spec_decode_num_draft_tokens_total") - drafts
    accepted = (
        spec_server.metric("vllm:spec_decode_num_accepted_tokens_total") - accepted
    )
    assert 0 < accepted < drafts, (accepted, drafts)
