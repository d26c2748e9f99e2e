"""Shared test set-up: the model-runner axis (v1, or v2 with TRITON_INTERPRET=1).

Fixtures of one test folder live in its conftest.py (tests/series/ holds the
synthetic vLLM trees and patch series). Test modules get helpers through
fixtures, never `from conftest import ...`: with several conftest.py files the
name `conftest` is ambiguous.
"""

from __future__ import annotations

import pytest

# The runner axis. A session runs one vLLM model runner, because vLLM reads
# Triton's presence once per process: plain `pytest` runs every test on Model
# Runner V1 (vLLM's CPU default); `TRITON_INTERPRET=1 pytest` runs the tests
# marked `mrv2` on Model Runner V2, with Triton's interpreter as the CPU backend
# (vllm_hs.triton_interpreter, registered at interpreter start by the .pth hook
# tox installs, so also in spawned engine and server processes). tox runs both
# sessions; `vllm_hs.testing.engine` checks every engine's workers run the
# session's runner.
from vllm_hs.triton_interpreter import interpreter_requested, register  # noqa: E402

RUNNER = "v2" if interpreter_requested() else "v1"
if RUNNER == "v2" and not register():
    raise pytest.UsageError(
        "TRITON_INTERPRET=1 (Model Runner V2 tests) needs triton: "
        "pip install --no-deps -r requirements/mrv2-cpu.txt"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "mrv2: also runs on Model Runner V2 (TRITON_INTERPRET=1 pytest)"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"vLLM model runner: {RUNNER} (tests marked mrv2 run on v2)"


@pytest.hookimpl(tryfirst=True)  # before the conftests that plan around items
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if RUNNER != "v2":
        return
    selected = [item for item in items if item.get_closest_marker("mrv2")]
    deselected = [item for item in items if not item.get_closest_marker("mrv2")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # `tox -e tests -- <a path without mrv2 tests>` runs nothing on v2: fine.
    if RUNNER == "v2" and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK
