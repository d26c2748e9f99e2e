"""Fixtures for the series-maintenance tests: vLLM's sdists and staged trees.

The sdists come from PyPI (cached under $VLLM_HS_CACHE/sdists), like the upstream
wheels of the other tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hs.series.sdist import fetch_sdist
from vllm_hs.series.stage import StagedTree, stage

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES_ROOT = REPO_ROOT / "patches"
VERSIONS = ("0.32.0", "0.33.0")


@pytest.fixture(scope="session")
def series_root() -> Path:
    """The shipped series (patches/)."""
    return SERIES_ROOT


@pytest.fixture(scope="session")
def sdist() -> dict[str, Path]:
    return {version: fetch_sdist(version) for version in VERSIONS}


@pytest.fixture(scope="session")
def staged_032(tmp_path_factory: pytest.TempPathFactory, sdist) -> StagedTree:
    """vLLM 0.32.0 staged with the shipped series; tests must not change it."""
    dest = tmp_path_factory.mktemp("stage") / "vllm-0.32.0"
    return stage("0.32.0", dest=dest, sdist=sdist["0.32.0"], series_root=SERIES_ROOT)
