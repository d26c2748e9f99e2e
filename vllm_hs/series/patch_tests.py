"""`vllm-hs upstream-tests --each-patch`: every patch's own tests, at its commit.

A stack is reviewed one PR at a time, so each PR's tests must pass with that PR
and the ones beneath it, not only at the top of the stack. For each patch of the
series this checks out the staged branch at the patch's commit and runs the test
modules the patch adds or changes (`tests/**/test_*.py`), on CPU, the way
`vllm-hs upstream-tests` runs vLLM's tests (`vllm_hs.series.upstream_tests`).

`--beneath PATCH` applies a later patch of the series under every earlier commit
(v0.32.0's CPU platform patch, Not-for-upstream and last: without it no engine
config builds on a CPU without Triton).

The verdict, per test: it must pass at the patch's commit, unless it is one the
patch did not add and it does not pass at the commit beneath either (vLLM's own
tests that cannot run here, e.g. those that fetch assets).
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from vllm_hs.errors import VllmHsError
from vllm_hs.series.git import GitError, Repo
from vllm_hs.series.model import default_series_root
from vllm_hs.series.stage import stage
from vllm_hs.series.upstream_tests import (
    Outcome,
    TreeRun,
    _run_pytest,
    overlay_extensions,
    write_offline_hub,
)

_NOT_PASSING = (Outcome.FAILED, Outcome.ERROR)


@dataclass(frozen=True)
class PatchTests:
    """One patch's own test modules, run at its commit."""

    patch: str
    tests: tuple[str, ...]
    at_commit: TreeRun | None  # None: the patch adds or changes no test module
    # The failing tests' modules run at the commit beneath the patch (None:
    # nothing failed, or none of those modules exists there).
    beneath: TreeRun | None = None

    @property
    def failures(self) -> list[str]:
        """Tests that fail at the commit and passed beneath it or are new."""
        if self.at_commit is None:
            return []
        before = self.beneath.outcomes if self.beneath is not None else {}
        return sorted(
            test
            for test, outcome in self.at_commit.outcomes.items()
            if outcome in _NOT_PASSING
            and (test not in before or before[test] is Outcome.PASSED)
        )

    @property
    def cannot_run(self) -> list[str]:
        """Tests that fail at the commit and beneath it alike."""
        if self.at_commit is None:
            return []
        failing = set(self.failures)
        return sorted(
            test
            for test, outcome in self.at_commit.outcomes.items()
            if outcome in _NOT_PASSING and test not in failing
        )


def own_test_modules(repo: Repo, commit: str) -> list[str]:
    """Test modules `commit` adds or changes, as paths in the tree."""
    changed = repo.git(
        "diff", "--name-only", "--diff-filter=AM", f"{commit}^", commit, "--", "tests/"
    ).split()
    return [
        path
        for path in changed
        if PurePosixPath(path).name.startswith("test_") and path.endswith(".py")
    ]


def each_patch(
    version: str,
    *,
    series_root: Path | None = None,
    sdist: Path | None = None,
    beneath: list[str] | None = None,
    keep: Path | None = None,
    timeout: int = 300,
) -> list[PatchTests]:
    series_root = series_root or default_series_root()
    with contextlib.ExitStack() as stack:
        work = (
            keep.resolve()
            if keep is not None
            else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        staged = stage(
            version, dest=work / "repo", sdist=sdist, series_root=series_root
        )
        repo = staged.repo
        commits_list = repo.git(
            "rev-list", "--reverse", f"{staged.base}..{staged.branch}"
        ).split()
        names = [patch.name for patch in staged.series.patches]
        unknown = sorted(set(beneath or ()) - set(names))
        if unknown:
            raise VllmHsError(
                f"--beneath {', '.join(unknown)}: not a patch of series "
                f"{staged.series.name}"
            )
        under = [(names.index(b), commits_list[names.index(b)]) for b in beneath or ()]
        tree = stack.enter_context(
            repo.worktree(work / "tree", staged.base, keep=keep is not None)
        )
        tree_repo = Repo(tree)
        overlay_extensions(tree)
        hf_home = write_offline_hub(work / "hf-home")
        results = []
        for index, (commit, name) in enumerate(zip(commits_list, names, strict=True)):
            tests = own_test_modules(repo, commit)
            if not tests:
                results.append(PatchTests(name, (), None))
                continue
            later = [sha for position, sha in under if position > index]
            run = _run_at(tree_repo, commit, later, name, tests, hf_home, work, timeout)
            beneath_run = None
            failing = [t for t, o in run.outcomes.items() if o in _NOT_PASSING]
            files = sorted({t.split("::")[0] for t in failing})
            present = [f for f in files if _exists_at(repo, f"{commit}^", f)]
            if present:
                beneath_run = _run_at(
                    tree_repo,
                    f"{commit}^",
                    later,
                    f"{name}.beneath",
                    present,
                    hf_home,
                    work,
                    timeout,
                )
            results.append(PatchTests(name, tuple(tests), run, beneath_run))
    return results


def _exists_at(repo: Repo, ref: str, path: str) -> bool:
    return bool(repo.git("ls-tree", "--name-only", ref, "--", path).strip())


def _run_at(
    tree_repo: Repo,
    ref: str,
    later: list[str],
    name: str,
    tests: list[str],
    hf_home: Path,
    work: Path,
    timeout: int,
) -> TreeRun:
    """Run `tests` with the tree at `ref`, the `later` commits applied on top
    (uncommitted); the tree is reset afterwards."""
    tree_repo.git("checkout", "-q", "--force", "--detach", ref)
    try:
        for sha in later:
            try:
                tree_repo.git("cherry-pick", "-n", sha)
            except GitError as e:
                raise VllmHsError(
                    f"{name}: the patch of commit {sha[:12]} does not apply "
                    f"beneath {ref}: {e}"
                ) from None
        return _run_pytest(name, tree_repo.path, tests, hf_home, work, timeout)
    finally:
        if tree_repo.in_progress():
            tree_repo.git("cherry-pick", "--abort", check=False)
        tree_repo.git("reset", "-q", "--hard")


def report(version: str, beneath: list[str], results: list[PatchTests]) -> str:
    flags = "".join(f" --beneath {name}" for name in beneath)
    lines = [
        f"# vLLM {version}: each patch's own tests, at its commit",
        "",
        f"Generated by `vllm-hs upstream-tests --version {version} --each-patch"
        f"{flags}`.",
        "",
        "Per patch, the test modules it adds or changes, run on CPU with the patch",
        "and those beneath it"
        + (f" ({', '.join(beneath)} applied under it)" if beneath else "")
        + ". A test fails the patch if it fails there and",
        "passes beneath the patch, or is new.",
        "",
        "| patch | test modules | passed | failed | errors | skipped | failing |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        run = result.at_commit
        if run is None:
            lines.append(f"| {result.patch} | none | | | | | |")
            continue
        modules = "<br>".join(f"`{test}`" for test in result.tests)
        lines.append(
            f"| {result.patch} | {modules} | {run.count(Outcome.PASSED)} | "
            f"{run.count(Outcome.FAILED)} | {run.count(Outcome.ERROR)} | "
            f"{run.count(Outcome.SKIPPED)} | {len(result.failures)} |"
        )
    failing = [(r, t) for r in results for t in r.failures]
    lines += ["", f"## Failures: {len(failing)}", ""]
    for result, test in failing:
        assert result.at_commit is not None
        message = result.at_commit.messages.get(test, "")
        lines.append(f"- {result.patch}: `{test}`: {message}")
    cannot = [r for r in results if r.cannot_run]
    if cannot:
        lines += [
            "",
            "## Cannot run here (they fail beneath the patch as well)",
            "",
            "Grouped by the first line of the error; on a machine with network",
            "access and a GPU most of these run.",
            "",
        ]
    for result in cannot:
        assert result.at_commit is not None
        groups: dict[str, list[str]] = {}
        for test in result.cannot_run:
            reason = result.at_commit.messages.get(test, "") or "no message"
            groups.setdefault(reason, []).append(test)
        lines.append(f"- {result.patch}:")
        for reason, tests in sorted(groups.items(), key=lambda g: -len(g[1])):
            shown = ", ".join(f"`{test}`" for test in tests[:2])
            more = f" and {len(tests) - 2} more" if len(tests) > 2 else ""
            lines.append(f"  - {len(tests)} x {reason}: {shown}{more}")
    return "\n".join(lines) + "\n"
