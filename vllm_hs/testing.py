"""Test support shared by tests/engine, tests/server and tests/extract: whether
the patched vLLM is there, and an engine that cleans up after itself.

Heavy imports (vllm) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_hs.triton_interpreter import interpreter_requested


def patched_vllm_skip_reason() -> str:
    """'' when the importable vLLM has the hidden-state channel, else why not.

    With VLLM_HS_EXPECT_PATCHED=1 (set by tox) a missing or unpatched vLLM is an
    error, never a reason to skip.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if os.environ.get("VLLM_HS_EXPECT_PATCHED") == "1":
        import vllm

        if not hasattr(vllm, "HiddenStatesParams"):
            raise AssertionError(f"vllm at {vllm.__file__} is unpatched")
        return ""
    try:
        import vllm
    except ImportError:
        return "vLLM is not installed"
    return "" if hasattr(vllm, "HiddenStatesParams") else "unpatched vLLM"


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
        worker_extension_cls=f"{__name__}.ChannelStateProbe",
    )
    options.update(kwargs)
    if interpreter_requested():
        # Triton's interpreter stands in for a compiler: nothing to compile.
        options["enforce_eager"] = True
    llm = LLM(model_dir, **options)
    try:
        check_model_runner(llm)
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def expected_model_runner() -> str:
    """The model runner vLLM selects for this process's engines: the one
    `VLLM_USE_V2_MODEL_RUNNER` forces, else "v2" (Model Runner V2) where Triton
    runs (Triton's interpreter as a CPU backend, `vllm_hs.triton_interpreter`,
    or CUDA), else "v1"."""
    from vllm.envs import maybe_convert_bool  # vLLM's own reading of the flag

    forced = maybe_convert_bool(os.environ.get("VLLM_USE_V2_MODEL_RUNNER"))
    if forced is not None:
        return "v2" if forced else "v1"
    if interpreter_requested():
        return "v2"
    import torch

    return "v2" if torch.cuda.is_available() else "v1"


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
    "vllm_hs.testing.ChannelStateProbe"``): what the worker side of the channel
    still holds, through ``collective_rpc("hidden_states_request_ids")`` (or the
    server's dev-mode ``/collective_rpc``)."""

    model_runner: Any  # set by vLLM's worker

    def model_runner_kind(self) -> str:
        """Which model runner this worker runs: "v2" or "v1"."""
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

        return "v2" if isinstance(self.model_runner, ModelRunnerV2) else "v1"

    def hidden_states_request_ids(self) -> list[str]:
        capturer = getattr(self.model_runner, "hidden_states_capturer", None)
        return [] if capturer is None else sorted(capturer.request_ids)


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
