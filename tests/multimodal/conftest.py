"""Fixtures for the channel on a vision-language target (tox -e multimodal).

vLLM's Qwen2.5-VL imports torchvision, which only PyPI's CUDA build of torch
provides (requirements/multimodal.txt): these tests run in their own tox
environment, and `tox -e tests` leaves this folder out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from vllm_hs.models.tiny_vl import build_tiny_vl_model
from vllm_hs.patched_vllm import skip_reason
from vllm_hs_testing.engines import MODES, engine
from vllm_hs_testing.vision import VL_BLOCK, VL_LAYERS, VL_STORE_BYTES

pytest.importorskip("torchvision", reason="tests/multimodal run in tox -e multimodal")

SKIP_REASON = skip_reason()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/multimodal/" in item.nodeid:
            item.add_marker(pytest.mark.engine)
            if SKIP_REASON:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def vl_fp32() -> str:
    return str(build_tiny_vl_model("float32"))


@pytest.fixture(scope="module", params=MODES)
def vl_engine(
    request: pytest.FixtureRequest, vl_fp32: str
) -> Iterator[tuple[Any, str]]:
    """Qwen2.5-VL fp32 with chunked prefill (32-token budget, which cuts through
    a 16-token image), prefix caching on 16-token blocks with the prefix-row
    store, two images per prompt; yields (llm, mode)."""
    mode = request.param
    with engine(
        vl_fp32,
        mode,
        dtype="float32",
        hidden_states_config={"layers": VL_LAYERS, "store_bytes": VL_STORE_BYTES},
        max_num_batched_tokens=32,
        max_num_seqs=8,
        enable_prefix_caching=True,
        block_size=VL_BLOCK,
        limit_mm_per_prompt={"image": 2, "video": 0},
        enforce_eager=(mode == "inproc"),
    ) as llm:
        yield llm, mode
