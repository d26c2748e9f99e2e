"""Engines for tests (tests/engine, tests/extract) and benchmarks: a vLLM `LLM`
that cleans up after itself and checks its workers run the session's model
runner, the engine modes, option sets several test modules share, and what is
read back from a running engine (the worker probe's answers, metrics).

Heavy imports (vllm) happen inside the functions: worker processes import this
package to load `ChannelStateProbe`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

MODES = ("inproc", "mp")
"""Engine modes: the in-process engine core (no serialization) and the default
multiprocess engine (worker -> core over shared memory, core -> frontend over
msgpack)."""

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
    512-token context, a 64 MiB KV cache and the worker probe
    (`ChannelStateProbe`); kwargs override them."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    if mode not in MODES:
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
