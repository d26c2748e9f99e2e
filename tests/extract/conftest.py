"""Fixtures for the `vllm-hs extract` tests.

Everything is real: the patched engine, HF transformers as the reference, the
`datasets` package writing and reading the Arrow dataset and speculators' own
training dataset class reading the output. Under tox (VLLM_HS_EXPECT_PATCHED=1)
a missing piece is a failure; elsewhere the tests that need it are skipped.

The in-process engine is module-scoped (one per test module that asks for it,
shut down before the next module starts its own); CLI tests run `vllm-hs
extract` in subprocesses with vLLM's default multiprocess engine.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_hs.patched_vllm import expect_patched, is_patched
from vllm_hs_testing import engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

EXPECT_PATCHED = expect_patched()

#: Layers of the test engine: three aux layers and L = 4 (the CLI default for the
#: tiny model).
LAYERS = [1, 2, 3, 4]


def _missing(modules: tuple[str, ...]) -> str:
    """Why these modules cannot be used ('' when they can)."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            return f"{name} is not installed ({e})"
        if name == "vllm" and not is_patched(module):
            return f"vllm at {module.__file__} is unpatched"
    return ""


ENGINE_REASON = _missing(("vllm", "datasets", "speculators.train.data"))
DATASETS_REASON = _missing(("datasets",))
if EXPECT_PATCHED:
    # tox: the patched wheel and requirements/extract.txt must be installed.
    assert not ENGINE_REASON, ENGINE_REASON

#: Test modules that start engines (in-process or CLI subprocesses).
ENGINE_MODULES = (
    "test_acceptance.py",
    "test_extract_bf16.py",
    "test_extract_cli.py",
    "test_extract_engine.py",
    "test_extract_ray.py",
    "test_extract_regenerate.py",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "extract: tests of vllm-hs extract (tests/extract)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/extract/" not in item.nodeid:
            continue
        item.add_marker(pytest.mark.extract)
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        if module in ENGINE_MODULES:
            item.add_marker(pytest.mark.engine)
            if ENGINE_REASON:
                item.add_marker(pytest.mark.skip(reason=ENGINE_REASON))


@pytest.fixture
def need_datasets() -> None:
    """Skip (fail under tox) when the `datasets` package is missing."""
    if DATASETS_REASON:
        if EXPECT_PATCHED:
            pytest.fail(DATASETS_REASON)
        pytest.skip(DATASETS_REASON)


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_hs.models.tiny import build_tiny_model

    return str(build_tiny_model("llama", "float32"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def shipped() -> list[list[dict[str, str]]]:
    """The conversation set shipped in vllm_hs/data, normalized."""
    from vllm_hs.extract.inputs import load_conversations, shipped_conversations_path

    return load_conversations(shipped_conversations_path())[0]


def _inproc_engine(model_dir: str, **kwargs: Any) -> Any:
    """An in-process vLLM `LLM` (eager, fp32, the model's own context length),
    shut down and cleaned up on exit."""
    options: dict[str, Any] = dict(
        hidden_states_config={"layers": LAYERS},
        dtype="float32",
        kv_cache_memory_bytes=128 << 20,
        max_model_len=None,
        enforce_eager=True,
    )
    options.update(kwargs)
    return engine(model_dir, "inproc", **options)


@pytest.fixture(name="inproc_engine", scope="session")
def inproc_engine_fixture() -> Callable[..., Any]:
    return _inproc_engine


@pytest.fixture(scope="module")
def llm(model_dir: str) -> Iterator[Any]:
    with _inproc_engine(model_dir) as shared_llm:
        yield shared_llm


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(name="write_jsonl", scope="session")
def write_jsonl_fixture() -> Callable[[Path, list[Any]], Path]:
    return _write_jsonl


def _file_digests(output: Path) -> dict[str, str]:
    """sha256 of every hs file, the Arrow data files and token_freq.pt."""
    import hashlib

    files = [
        *sorted((output / "hidden_states").glob("*")),
        *sorted(output.glob("data-*.arrow")),
        output / "token_freq.pt",
    ]
    return {
        p.relative_to(output).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files
    }


@pytest.fixture(name="file_digests", scope="session")
def file_digests_fixture() -> Callable[[Path], dict[str, str]]:
    return _file_digests


def _run_extract(llm: Any, conversations: list, output: Path, **kwargs: Any) -> Any:
    """`vllm_hs.extract.job.extract` with the test engine's layers, quiet;
    ``kwargs``: fields of `ExtractSettings`."""
    from vllm_hs.extract.job import extract
    from vllm_hs.extract.settings import ExtractSettings

    kwargs.setdefault("layers", LAYERS)
    kwargs.setdefault("data_sha256", "test")
    kwargs.setdefault("progress", False)
    return extract(llm, conversations, ExtractSettings(output=output, **kwargs))


@pytest.fixture(name="run_extract", scope="session")
def run_extract_fixture() -> Callable[..., Any]:
    return _run_extract
