"""Streaming output kinds: DELTA carries only new rows (prompt rows once, with
the first token), CUMULATIVE all rows so far, FINAL_ONLY everything at the end;
concatenated deltas equal the final tensor. Through AsyncLLM (always the
multiprocess engine) and through LLMEngine in-process."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import defaultdict

import pytest
import torch

from vllm_hs.hf_reference import assert_states_close, hf_sequence_states
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import engine, expected_model_runner
from vllm_hs_testing.requests import tokens_prompt

LAYERS = [0, -1, "final_norm"]
RESOLVED = [0, 4, "final_norm"]
KINDS = ("DELTA", "CUMULATIVE", "FINAL_ONLY")


def _params(kind: str, n: int = 1, max_tokens: int = 9):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=0.0 if n == 1 else 1.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind[kind],
        hidden_states={},
    )


def snapshot(out):
    """CUMULATIVE outputs share vLLM's live token list, which keeps growing after
    the output was yielded: copy it when the output arrives."""
    for c in out.outputs:
        c.token_ids = list(c.token_ids)
    return out


def check_stream(outputs: list, kind: str, n: int, model_dir: str, what: str) -> None:
    """Check the sequence of RequestOutputs of one request."""
    assert outputs and outputs[-1].finished, what
    prompt_ids = list(outputs[0].prompt_token_ids)
    prompt_seen = [o.prompt_hidden_states for o in outputs]
    tokens: dict[int, list[int]] = defaultdict(list)
    rows: dict[int, list[torch.Tensor]] = defaultdict(list)
    final: dict[int, torch.Tensor | None] = {}
    for out in outputs:
        for c in out.outputs:
            if kind == "DELTA":
                tokens[c.index].extend(c.token_ids)
                if c.hidden_states is not None:
                    rows[c.index].append(c.hidden_states)
            else:
                tokens[c.index] = list(c.token_ids)
                final[c.index] = c.hidden_states
                if c.hidden_states is not None:
                    assert c.hidden_states.shape[0] == max(len(c.token_ids) - 1, 0)
    if kind == "DELTA":
        sent = [p for p in prompt_seen if p is not None]
        assert len(sent) == 1, f"{what}: prompt rows sent {len(sent)} times"
        first_with_tokens = next(
            o for o in outputs if any(c.token_ids for c in o.outputs)
        )
        assert first_with_tokens.prompt_hidden_states is not None, (
            f"{what}: prompt rows did not come with the first token"
        )
        prompt_rows = sent[0]
        for index, chunks in rows.items():
            final[index] = torch.cat(chunks)
    elif kind == "CUMULATIVE":
        assert all(p is not None for p in prompt_seen), what
        prompt_rows = prompt_seen[-1]
    else:
        assert len(outputs) == 1, f"{what}: FINAL_ONLY gave {len(outputs)} outputs"
        prompt_rows = prompt_seen[0]
    assert len(tokens) == n, f"{what}: {len(tokens)} completions"
    for index, token_ids in tokens.items():
        ref_prompt, ref_output = hf_sequence_states(
            model_dir, prompt_ids, token_ids, RESOLVED
        )
        assert_states_close(
            prompt_rows, ref_prompt, dtype=torch.float32, what=f"{what} prompt"
        )
        assert final.get(index) is not None, f"{what}: no rows for completion {index}"
        assert_states_close(
            final[index],
            ref_output,
            dtype=torch.float32,
            what=f"{what} completion {index}",
            row_offset=len(prompt_ids),
        )


def test_output_kinds_async_llm(llama_fp32):
    """AsyncLLM.generate, as the server uses it (multiprocess engine)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    args = AsyncEngineArgs(
        model=llama_fp32,
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        max_num_batched_tokens=32,
        enforce_eager=True,
        hidden_states_config={"layers": LAYERS},
        worker_extension_cls="vllm_hs_testing.ChannelStateProbe",
    )
    # (kind, n, consumer delay): a slow DELTA consumer makes AsyncLLM merge
    # outputs (RequestOutput.add) before it takes them.
    cases = [(kind, 1, 0.0) for kind in KINDS] + [
        ("DELTA", 2, 0.0),
        ("CUMULATIVE", 2, 0.0),
        ("DELTA", 1, 0.5),
    ]

    async def run() -> tuple[list[list], list[str]]:
        llm = AsyncLLM.from_engine_args(args)
        try:
            kinds = await llm.collective_rpc("model_runner_kind")
            assert kinds == [expected_model_runner()], kinds

            async def one(i: int, kind: str, n: int, delay: float) -> list:
                prompt = tokens_prompt(seeded_prompt(700 + i, 30 + 11 * i))
                outputs = []
                async for out in llm.generate(
                    prompt, _params(kind, n), request_id=str(uuid.uuid4())
                ):
                    outputs.append(snapshot(out))
                    await asyncio.sleep(delay)
                return outputs

            async def streaming_input() -> str:
                """A resumable (streaming-input) request asking for states."""
                from vllm.engine.protocol import StreamingInput

                async def chunks():
                    for k in range(2):
                        prompt = tokens_prompt(seeded_prompt(750 + k, 10))
                        yield StreamingInput(prompt=prompt)

                params = _params("DELTA")
                try:
                    async for _ in llm.generate(
                        chunks(), params, request_id=str(uuid.uuid4())
                    ):
                        pass
                except Exception as e:  # the error of the input stream
                    return f"{type(e).__name__}: {e}"
                return "no error"

            results = await asyncio.gather(
                *(one(i, *case) for i, case in enumerate(cases)), streaming_input()
            )
            return list(results[:-1]), [results[-1]]
        finally:
            llm.shutdown()

    results, (streaming_error,) = asyncio.run(run())
    assert "streaming-input (resumable)" in streaming_error, streaming_error
    for (kind, n, delay), outputs in zip(cases, results, strict=True):
        what = f"[async {kind} n={n} delay={delay}]"
        check_stream(outputs, kind, n, llama_fp32, what)
        if delay:
            num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            assert len(outputs) < num_tokens, f"{what}: no output was merged"


@pytest.mark.parametrize("kind", KINDS)
def test_output_kinds_llm_engine_inproc(llama_fp32, kind):
    """LLMEngine in-process (no serialization), stepping by hand."""
    with engine(
        llama_fp32,
        "inproc",
        dtype="float32",
        max_num_batched_tokens=32,
        enforce_eager=True,
        hidden_states_config={"layers": LAYERS},
    ) as llm:
        llm_engine = llm.llm_engine
        cases = {"a": (1, 45), "b": (2, 17)}
        for req_id, (n, length) in cases.items():
            llm_engine.add_request(
                req_id,
                tokens_prompt(seeded_prompt(800 + length, length)),
                _params(kind, n),
            )
        collected: dict[str, list] = defaultdict(list)
        for _ in range(500):
            if not llm_engine.has_unfinished_requests():
                break
            for out in llm_engine.step():
                collected[out.request_id].append(snapshot(out))
        assert not llm_engine.has_unfinished_requests()
    for req_id, (n, _) in cases.items():
        check_stream(
            collected[req_id], kind, n, llama_fp32, f"[inproc {kind} {req_id}]"
        )
