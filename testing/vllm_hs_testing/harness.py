"""The engine harness of the tests (tests/engine, tests/server, tests/extract):
whether the patched vLLM is there, an engine that cleans up after itself and
checks its workers run the session's model runner, and the checks of a
request's hidden-state rows against HF transformers.

Every check recomputes the expected rows with HF transformers on the same weights
(`vllm_hs.hf_reference`) from the request's own prompt and generated tokens, so
a row from the wrong position, layer or request fails, as do zeros.
Heavy imports (vllm) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hs.hf_reference import assert_states_close, hf_sequence_states
from vllm_hs.models.tiny import seeded_prompt

MODES = ("inproc", "mp")
"""Engine modes: the in-process engine core (no serialization) and the default
multiprocess engine (worker -> core over shared memory, core -> frontend over
msgpack)."""

# Layer set of the main test engine and server; -1 resolves to L=4 of the tiny
# model (hidden size 128, fp32).
NUM_LAYERS = 4
MAIN_LAYERS: list[int | str] = [0, 2, -1, "final_norm"]
MAIN_RESOLVED: list[int | str] = [0, 2, 4, "final_norm"]
HIDDEN = 128
ROW_BYTES = len(MAIN_LAYERS) * HIDDEN * 4  # fp32
CAP_ROWS = 256
CAP_BYTES = CAP_ROWS * ROW_BYTES  # max_bytes_per_request of the main engine
BUDGET = 32  # max_num_batched_tokens: long prompts prefill in many chunks
PREFIX_STORE_BLOCKS = 4  # rows of 32-token blocks the main engine keeps
PREFIX_STORE_BYTES = PREFIX_STORE_BLOCKS * 32 * ROW_BYTES


NGRAM: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
"""ngram speculation with 3 drafts (finds drafts in `repeated_prompt` text)."""

PREEMPTING: dict[str, Any] = dict(
    max_model_len=256,
    block_size=32,
    kv_cache_memory_bytes=640 * 2048,  # 2 KiB of KV per token in the tiny llama
    max_num_batched_tokens=64,
    max_num_seqs=8,
    disable_log_stats=False,
    enforce_eager=True,
)
"""Engine options of a 640-token KV cache for up to 8 requests: preemptions
under load, chunked prefill of 64 tokens, metrics on."""


@contextlib.contextmanager
def engine(model_dir: str, mode: str = "inproc", **kwargs: Any) -> Iterator[Any]:
    """A vLLM `LLM` in `mode` ("inproc": engine core in this process; "mp": the
    default multiprocess engine), shut down and cleaned up on exit. Defaults: a
    512-token context and a 64 MiB KV cache; kwargs override them."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    if mode not in ("inproc", "mp"):
        raise ValueError(f"mode must be 'inproc' or 'mp', got {mode!r}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "mp" else "0"
    options: dict[str, Any] = dict(
        max_model_len=512,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        worker_extension_cls="vllm_hs_testing.ChannelStateProbe",
    )
    options.update(kwargs)
    llm = LLM(model_dir, **options)
    try:
        check_model_runner(llm)
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


@contextlib.contextmanager
def async_scheduling_on_cpu() -> Iterator[None]:
    """Engines made inside have async scheduling on, as on vLLM's GPU default:
    set after the CPU platform's config pass, which turns it off. The config is
    built in this process, so the multiprocess engine core gets it too."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


def expected_model_runner() -> str:
    """The model runner vLLM selects for this process's engines: the one
    `VLLM_USE_V2_MODEL_RUNNER` forces, else "v2" (Model Runner V2) where its
    kernels run (CUDA; a CPU whose vLLM implements them without Triton, as
    the series does), else "v1"."""
    from vllm.envs import maybe_convert_bool  # vLLM's own reading of the flag

    forced = maybe_convert_bool(os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
    if forced is not None:
        return "v2" if forced else "v1"
    import torch
    from vllm.platforms import current_platform

    without_triton = getattr(
        current_platform, "supports_v2_model_runner_without_triton", None
    )
    if without_triton is not None and without_triton():
        return "v2"
    return "v2" if torch.cuda.is_available() else "v1"


def speculation_modes() -> tuple[str, ...]:
    """Engine modes of the speculative-decoding tests: both, on either model
    runner."""
    return MODES


def check_model_runner(llm: Any) -> None:
    """Fail unless every worker of `llm` runs the runner this test session is
    for: a worker process that silently fell back to the other runner would
    pass every row check while testing the wrong code. Needs the
    `ChannelStateProbe` worker extension."""
    expected = expected_model_runner()
    kinds = llm.collective_rpc("model_runner_kind")
    if any(kind != expected for kind in kinds):
        raise AssertionError(f"workers run model runners {kinds}, expected {expected}")


class ChannelStateProbe:
    """A vLLM worker extension for tests (``worker_extension_cls=
    "vllm_hs_testing.ChannelStateProbe"``): what the worker side of the channel
    still holds, through ``collective_rpc("hidden_states_request_ids")`` (or the
    server's dev-mode ``/collective_rpc``)."""

    model_runner: Any  # set by vLLM's worker

    def model_runner_kind(self) -> str:
        """Which model runner this worker runs: "v2" or "v1"."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

        return "v2" if isinstance(self.model_runner, ModelRunnerV2) else "v1"

    def hidden_states_request_ids(self) -> list[str]:
        connector = getattr(self.model_runner, "aux_output_connector", None)
        worker = getattr(connector, "hidden_states", None)
        return [] if worker is None else sorted(worker.request_ids)


def poll_until_empty(
    fetch: Callable[[], list[str]], timeout: float = 10.0
) -> list[str]:
    """Call `fetch` until it returns an empty list or `timeout` seconds pass;
    return its last answer (for state a worker drops on the engine's next
    step, which comes asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        items = fetch()
        if not items or time.monotonic() > deadline:
            return items
        time.sleep(0.1)


def worker_request_ids(llm: Any, mode: str) -> list[str]:
    """Requests the worker's capturer still holds once the engine told it of
    every finished request. The worker learns of them on the next step, which
    schedules no tokens when nothing else runs: the multiprocess engine core
    takes that step by itself (poll until it did); in-process, step once."""
    if mode == "inproc":
        llm.llm_engine.step()
    return poll_until_empty(
        lambda: [i for r in llm.collective_rpc("hidden_states_request_ids") for i in r]
    )


# --- requests and their checks against HF ----------------------------------


def greedy(max_tokens: int, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


def tokens_prompt(token_ids: Sequence[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(token_ids))


def engine_metric(llm: Any, name: str) -> float:
    """A metric of `llm` summed over its label sets (the engine needs
    `disable_log_stats=False`); fails when the engine does not report it."""
    values = [
        float(getattr(metric, "value", 0) or 0)
        for metric in llm.get_metrics()
        if metric.name == name
    ]
    if not values:
        raise AssertionError(f"{name} not among the engine's metrics")
    return sum(values)


def repeated_prompt(seed: int, length: int, period: int) -> list[int]:
    """A seeded phrase of `period` tokens repeated to `length`: text in which
    ngram speculation finds drafts."""
    phrase = seeded_prompt(seed, period)
    return (phrase * (length // period + 1))[:length]


@dataclass
class Expect:
    """What a request asked for, resolved to the layer ids of its columns."""

    layers: list[int | str]
    prompt: bool = True
    output: bool = True
    positions: str | list[list[int]] | None = None
    """`HiddenStatesParams.positions` of the request."""

    def selected(self, num_prompt: int, num_tokens: int) -> tuple[list[int], list[int]]:
        """(prompt positions, generated positions) whose rows the request
        returns, computed here from the documented conventions: "last" is
        P-1 and P+G-2 (none when G=1); windows are [start, end) ranges."""
        prompt = list(range(num_prompt)) if self.prompt else []
        output = list(range(num_prompt, num_prompt + num_tokens - 1))
        if not self.output:
            output = []
        if self.positions == "last":
            return prompt[-1:], output[-1:]
        if self.positions is not None:
            wanted = {p for start, end in self.positions for p in range(start, end)}
            prompt = [p for p in prompt if p in wanted]
            output = [p for p in output if p in wanted]
        return prompt, output


def check_output(
    request_output: Any,
    model_dir: str,
    expect: Expect | None,
    dtype: torch.dtype | str,
    what: str,
    tolerance_dtype: torch.dtype | str | None = None,
) -> None:
    """Check every hidden-state row of one RequestOutput (all completions).

    The reference runs in `dtype`; tolerances are those of `tolerance_dtype`
    (default: `dtype`)."""
    tol_dtype = dtype if tolerance_dtype is None else tolerance_dtype
    prompt_ids = list(request_output.prompt_token_ids)
    if expect is None:
        assert request_output.prompt_hidden_states is None, what
        for completion in request_output.outputs:
            assert completion.hidden_states is None, what
        return
    if expect.positions is not None:
        _check_selected_rows(request_output, model_dir, expect, dtype, what, tol_dtype)
        return
    prompt_rows = request_output.prompt_hidden_states
    checked_prompt = False
    for completion in request_output.outputs:
        token_ids = list(completion.token_ids)
        ref_prompt, ref_output = hf_sequence_states(
            model_dir, prompt_ids, token_ids, expect.layers, dtype=dtype
        )
        label = f"{what} completion {completion.index}"
        if expect.prompt and not checked_prompt:
            assert prompt_rows is not None, f"{what}: no prompt_hidden_states"
            assert prompt_rows.dtype == ref_prompt.dtype, (prompt_rows.dtype, what)
            assert_states_close(
                prompt_rows,
                ref_prompt,
                dtype=tol_dtype,
                what=f"{what} prompt",
                layers=expect.layers,
            )
            checked_prompt = True
        elif not expect.prompt:
            assert prompt_rows is None, f"{what}: unexpected prompt states"
        if expect.output:
            rows = completion.hidden_states
            assert rows is not None, f"{label}: no hidden_states"
            assert rows.shape[0] == max(len(token_ids) - 1, 0), (
                f"{label}: {rows.shape[0]} rows for {len(token_ids)} tokens"
            )
            assert_states_close(
                rows,
                ref_output,
                dtype=tol_dtype,
                what=f"{label} output",
                layers=expect.layers,
                row_offset=len(prompt_ids),
            )
        else:
            assert completion.hidden_states is None, f"{label}: unexpected rows"


def _check_selected_rows(
    request_output: Any,
    model_dir: str,
    expect: Expect,
    dtype: torch.dtype | str,
    what: str,
    tol_dtype: torch.dtype | str,
) -> None:
    """`check_output` for a request with `positions`: the rows are those of
    the selected positions, in order, and the outputs list those positions."""
    prompt_ids = list(request_output.prompt_token_ids)
    num_prompt = len(prompt_ids)
    prompt_rows = request_output.prompt_hidden_states
    for completion in request_output.outputs:
        token_ids = list(completion.token_ids)
        want_prompt, want_output = expect.selected(num_prompt, len(token_ids))
        ref_prompt, ref_output = hf_sequence_states(
            model_dir, prompt_ids, token_ids, expect.layers, dtype=dtype
        )
        label = f"{what} completion {completion.index}"
        if want_prompt and completion.index == 0:
            assert prompt_rows is not None, f"{what}: no prompt_hidden_states"
            got = request_output.prompt_hidden_states_positions
            assert got == want_prompt, f"{what}: prompt positions {got}"
            assert_states_close(
                prompt_rows,
                ref_prompt[want_prompt],
                dtype=tol_dtype,
                what=f"{what} prompt rows of {want_prompt[:8]}...",
                layers=expect.layers,
            )
        elif not want_prompt:
            assert prompt_rows is None, f"{what}: unexpected prompt states"
        if expect.output:
            rows = completion.hidden_states
            assert rows is not None, f"{label}: no hidden_states"
            got = completion.hidden_states_positions
            assert got == want_output, f"{label}: output positions {got}"
            assert_states_close(
                rows,
                ref_output[[p - num_prompt for p in want_output]],
                dtype=tol_dtype,
                what=f"{label} output rows of {want_output[:8]}...",
                layers=expect.layers,
            )
        else:
            assert completion.hidden_states is None, f"{label}: unexpected rows"


Case = tuple[list[int], Any, "Expect | None"]
"""(prompt token ids, SamplingParams, what the request asked for)."""


def run_cases(
    llm: Any,
    cases: Sequence[Case],
    model_dir: str,
    dtype: torch.dtype | str,
    label: str,
    tolerance_dtype: torch.dtype | str | None = None,
) -> list[Any]:
    """Generate all cases in one batch and check every output against HF."""
    outputs = llm.generate(
        [tokens_prompt(p) for p, _, _ in cases],
        [sp for _, sp, _ in cases],
        use_tqdm=False,
    )
    assert len(outputs) == len(cases)
    for i, (out, (prompt, _, expect)) in enumerate(zip(outputs, cases, strict=True)):
        assert list(out.prompt_token_ids) == list(prompt)
        check_output(out, model_dir, expect, dtype, f"{label} {i}", tolerance_dtype)
    return outputs


def rejected_then_served(
    engine: tuple[Any, str],
    model_dir: str,
    prompt: list[int],
    bad: Any,
    match: str,
    good: dict[str, Any],
) -> None:
    """On an `engine` (llm, mode) of a float32 model: `bad` hidden_states fail
    the request with `match`, then the same prompt with `good` ones is served,
    every row checked against HF."""
    import pytest

    llm, mode = engine
    with pytest.raises(ValueError, match=match):
        llm.generate([tokens_prompt(prompt)], greedy(3, hidden_states=bad))
    (out,) = llm.generate(
        [tokens_prompt(prompt)], greedy(3, hidden_states=good), use_tqdm=False
    )
    expect = Expect(MAIN_RESOLVED, positions=good.get("positions"))
    check_output(out, model_dir, expect, torch.float32, f"[{mode}] after {bad!r}")


def speculative_cases(
    prompts: Sequence[list[int]], windows: list[list[int]]
) -> list[tuple[list[int], Any, Expect | None]]:
    """Eight requests for a speculative engine, one per prompt: states and none,
    output states only, position `windows`, the last row, a layer subset, and
    max_tokens that end inside a draft step."""
    assert len(prompts) == 8, len(prompts)
    main = list(MAIN_RESOLVED)
    table: list[tuple[dict[str, Any] | None, Expect | None]] = [
        ({}, Expect(main)),
        ({}, Expect(main)),
        (None, None),
        ({"prompt": False}, Expect(main, prompt=False)),
        ({}, Expect(main)),
        ({"positions": windows}, Expect(main, positions=windows)),
        ({"positions": "last"}, Expect(main, positions="last")),
        ({"layers": ["final_norm", 0]}, Expect(["final_norm", 0])),
    ]
    max_tokens = (40, 7, 33, 40, 2, 40, 19, 40)
    return [
        (prompt, greedy(tokens, hidden_states=hs), expect)
        for prompt, tokens, (hs, expect) in zip(prompts, max_tokens, table, strict=True)
    ]


def check_stop_inside_drafts(
    llm: Any,
    model_dir: str,
    prompts: Sequence[Sequence[int]],
    layers: list[int | str],
    label: str,
) -> None:
    """A stop token among a step's accepted drafts: for each prompt, stop at
    the first greedy token (from position 6) not seen before it in HF's
    greedy continuation; the tokens after it and their rows are dropped, so
    the rows, checked against HF, end at the stop token's input. `layers`:
    the engine's resolved layer ids."""
    from vllm_hs.hf_reference import hf_greedy

    cases = []
    for prompt in prompts:
        reference = hf_greedy(model_dir, prompt, 30)
        k = next(j for j in range(6, 30) if reference[j] not in reference[:j])
        sp = greedy(30, stop_token_ids=[reference[k]], hidden_states={})
        cases.append((list(prompt), sp, Expect(layers)))
    outputs = run_cases(llm, cases, model_dir, torch.float32, label)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.hidden_states.shape[0] == len(completion.token_ids) - 1
