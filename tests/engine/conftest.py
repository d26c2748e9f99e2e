"""Fixtures for tests that start the real patched vLLM engine.

Engines are expensive (in-process ~2 s, multiprocess ~15-40 s), so each test
module shares one engine per mode. The in-process engine runs eager; the
multiprocess engine runs vLLM's default compiled (inductor) model, as users do.
"""

from __future__ import annotations

import pytest

from vllm_hs.models.tiny import build_tiny_model
from vllm_hs.patched_vllm import skip_reason
from vllm_hs_testing.engines import MODES, engine
from vllm_hs_testing.main_engine import (
    BUDGET,
    CAP_BYTES,
    MAIN_LAYERS,
    PREFIX_STORE_BYTES,
)

SKIP_REASON = skip_reason()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine/" not in item.nodeid:
            continue
        item.add_marker(pytest.mark.engine)
        if SKIP_REASON:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def llama_fp32() -> str:
    return str(build_tiny_model("llama", "float32"))


@pytest.fixture(scope="session")
def qwen3_bf16() -> str:
    return str(build_tiny_model("qwen3", "bfloat16"))


@pytest.fixture(scope="module", params=MODES)
def main_engine(request: pytest.FixtureRequest, llama_fp32: str):
    """Llama fp32 engine with chunked prefill (32-token budget), prefix caching
    on, a per-request cap and the worker probe (`ChannelStateProbe`); yields
    (llm, mode)."""
    mode = request.param
    with engine(
        llama_fp32,
        mode,
        dtype="float32",
        hidden_states_config={
            "layers": MAIN_LAYERS,
            "max_bytes_per_request": CAP_BYTES,
            "store_bytes": PREFIX_STORE_BYTES,
        },
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        enable_prefix_caching=True,
        block_size=32,  # the CPU default (128) would hide short shared prefixes
        enforce_eager=(mode == "inproc"),
        worker_extension_cls="vllm_hs_testing.ChannelStateProbe",
    ) as llm:
        yield llm, mode
