"""`vllm-hs upstream-tests --each-patch`: which test modules are a patch's own,
and when a failing test fails the patch (vllm_hs.series.patch_tests). The runs
themselves are vLLM's pytest on staged trees: patches/v<X>/EACH-PATCH-TESTS.md."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_hs.series.git import Repo
from vllm_hs.series.patch_tests import PatchTests, own_test_modules
from vllm_hs.series.upstream_tests import Outcome, TreeRun


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message],
        cwd=repo,
        check=True,
    )
    return subprocess.run(
        ["git", "rev-parse", "HEAD"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_a_patchs_own_tests_are_the_test_modules_it_adds_or_changes(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    _commit(tmp_path, {"tests/test_old.py": "", "tests/test_gone.py": ""}, "base")
    commit = _commit(
        tmp_path,
        {
            "tests/test_old.py": "x = 1\n",
            "tests/unit/test_new.py": "",
            "tests/unit/conftest.py": "",
            "tests/unit/helpers.py": "",
            "vllm/test_like_source.py": "",
        },
        "a patch",
    )
    assert sorted(own_test_modules(Repo(tmp_path), commit)) == [
        "tests/test_old.py",
        "tests/unit/test_new.py",
    ]


def _run(name: str, **outcomes: Outcome) -> TreeRun:
    run = TreeRun(name)
    run.outcomes = {f"tests/test_x.py::{k}": v for k, v in outcomes.items()}
    return run


def test_a_test_fails_the_patch_unless_it_fails_beneath_it_too():
    at_commit = _run(
        "patch",
        passes=Outcome.PASSED,
        broke=Outcome.FAILED,
        new=Outcome.ERROR,
        never_ran=Outcome.FAILED,
        skipped=Outcome.SKIPPED,
    )
    beneath = _run(
        "beneath", passes=Outcome.PASSED, broke=Outcome.PASSED, never_ran=Outcome.ERROR
    )
    result = PatchTests("0001-a.patch", ("tests/test_x.py",), at_commit, beneath)
    assert result.failures == ["tests/test_x.py::broke", "tests/test_x.py::new"]
    assert result.cannot_run == ["tests/test_x.py::never_ran"]
    # Nothing ran beneath (no failure at the commit, or no file there): every
    # failure is the patch's.
    alone = PatchTests("0001-a.patch", ("tests/test_x.py",), at_commit)
    assert len(alone.failures) == 3
    assert PatchTests("0002-b.patch", (), None).failures == []
