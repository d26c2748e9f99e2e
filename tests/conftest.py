"""Shared test set-up: the model-runner axis (v2, the default; or v1).

Fixtures of one test folder live in its conftest.py (tests/series/ holds the
synthetic vLLM trees and patch series). Test modules get helpers through
fixtures, never `from conftest import ...`: with several conftest.py files the
name `conftest` is ambiguous.
"""

from __future__ import annotations

import os

import pytest

# The runner axis. A session runs one vLLM model runner, as vLLM selects it
# per process. Plain `pytest` runs every test on Model Runner V2, which the
# patched wheel selects on CPU as on GPU (the series' Model Runner V2 on CPU
# without Triton); `VLLM_USE_V2_MODEL_RUNNER=0 pytest` runs the tests marked
# `mrv1` on Model Runner V1: plain generation with the patched wheel, and the
# refusal of hidden states there (an AuxOutput kind, which needs V2). tox runs
# both sessions; `vllm_hs_testing.engine` checks every engine's workers
# run the session's runner.
_FORCED = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
RUNNER = "v1" if _FORCED in ("0", "false") else "v2"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "mrv1: also runs on Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0 pytest)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"vLLM model runner: {RUNNER} (every test on v2, those marked mrv1 on v1)"


@pytest.hookimpl(tryfirst=True)  # before the conftests that plan around items
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if RUNNER != "v1":
        return
    selected = [item for item in items if item.get_closest_marker("mrv1")]
    deselected = [item for item in items if not item.get_closest_marker("mrv1")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # `tox -e tests -- <a path without mrv1 tests>` runs nothing on v1: fine.
    if RUNNER == "v1" and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
