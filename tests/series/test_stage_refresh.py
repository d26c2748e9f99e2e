"""vllm-hs stage and refresh on vLLM's real sdists and the shipped series."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_hs.cli import main
from vllm_hs.errors import VllmHsError
from vllm_hs.series.model import load_series
from vllm_hs.series.port import port
from vllm_hs.series.refresh import refresh
from vllm_hs.series.stage import StagedTree, stage

SERIES_ROOT = Path(__file__).resolve().parents[2] / "patches"

GIT_ENV = {
    "PATH": os.environ["PATH"],
    "HOME": os.environ.get("HOME", "/tmp"),
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
    "GIT_SEQUENCE_EDITOR": "true",
    "GIT_EDITOR": "true",
}


def git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
        env=GIT_ENV,
    ).stdout


def test_stage_makes_one_commit_per_patch_on_the_release_tag(
    staged_032: StagedTree,
) -> None:
    tree = staged_032.repo.path
    series = load_series(SERIES_ROOT, "0.32.0")
    log = git(tree, "log", "--reverse", "--format=%s", "v0.32.0..hidden-states-v0.32.0")
    subjects = log.splitlines()
    assert len(subjects) == len(series.patches)
    for subject, patch in zip(subjects, series.patches, strict=True):
        header = re.search(
            r"^Subject: \[PATCH\] (.*(?:\n .*)*)", patch.path.read_text(), re.MULTILINE
        )
        assert header is not None
        assert subject == " ".join(header.group(1).split())  # [Tag] kept by git am
        assert subject.startswith("[")
    bodies = git(tree, "log", "--format=%B", "v0.32.0..hidden-states-v0.32.0")
    statuses = [patch.headers["Upstream-Status"] for patch in series.patches]
    assert set(statuses) <= {
        "Pending",
        "Backport vLLM 0.33.0",
        "Backport vLLM 0.34.0",
        "Not-for-upstream",
    }
    assert bodies.count("Upstream-Status: ") == len(series.patches)
    assert bodies.count("Upstream-Status: Pending") == statuses.count("Pending")
    # Not-for-upstream patches come last.
    assert statuses == sorted(statuses, key=lambda status: status == "Not-for-upstream")
    assert bodies.count("vLLM-Version: 0.32.0") == len(series.patches)
    # The series carries no sign-off; each commit is signed off by whoever
    # staged it (the DCO needs a person), here the committer identity.
    committer = git(tree, "log", "-1", "--format=%cn <%ce>").strip()
    assert bodies.count(f"Signed-off-by: {committer}") == len(series.patches)
    for patch in series.patches:
        assert "Signed-off-by:" not in patch.path.read_text()
    # The tag is the pristine release: the sdist's version file, no series module.
    assert "0.32.0" in git(tree, "show", "v0.32.0:vllm/_version.py")
    files = git(tree, "ls-tree", "-r", "--name-only", "v0.32.0").splitlines()
    assert "vllm/_version.py" in files
    assert not [path for path in files if path.startswith("vllm/v1/hidden_states/")]
    assert git(tree, "status", "--porcelain") == ""


def test_footprint_splits_upstream_files_from_new_files(staged_032: StagedTree) -> None:
    footprint = staged_032.footprint()
    tree = staged_032.repo.path
    numstat = git(tree, "diff", "--numstat", "v0.32.0", "hidden-states-v0.32.0")
    total_added = sum(int(line.split("\t")[0]) for line in numstat.splitlines())
    assert sum(c.added for c in footprint.changes) == total_added
    new = {change.path for change in footprint.new}
    assert "vllm/distributed/aux_output_connector/hidden_states.py" in new
    assert "vllm/v1/core/sched/scheduler.py" not in new
    existing = {change.path for change in footprint.existing}
    assert "vllm/v1/core/sched/scheduler.py" in existing
    # The point of the design: hooks upstream, logic in new files.
    assert sum(c.added for c in footprint.new) > 3 * sum(
        c.added for c in footprint.existing
    )


def test_review_sizes_count_vllm_lines_per_patch(staged_032: StagedTree) -> None:
    tree = staged_032.repo.path
    sizes = staged_032.review_sizes()
    series = staged_032.series
    assert [size.patch for size in sizes] == [patch.name for patch in series.patches]
    numstat = git(tree, "diff", "--numstat", "v0.32.0", "hidden-states-v0.32.0")
    final = sum(
        int(added) + int(removed)
        for added, removed, path in (line.split("\t") for line in numstat.splitlines())
        if path.startswith("vllm/")
    )
    # Patch by patch counts at least the final diff (later patches may change
    # lines earlier ones added).
    assert sum(size.lines for size in sizes) >= final > 0
    by_name = {patch.name: patch for patch in series.patches}
    for size in sizes:
        headers = by_name[size.patch].headers
        assert size.channel == (
            headers["Upstream-Status"] == "Pending"
            and headers.get("Upstream-PR") != "separate"
        )
    channel = [size.patch for size in sizes if size.channel]
    assert channel and not any(
        by_name[name].headers.get("Upstream-PR") for name in channel
    )
    separate = [p.name for p in series.patches if p.headers.get("Upstream-PR")]
    assert separate and not set(separate) & set(channel)


def test_stage_cli_prints_diffstat_and_footprint(
    tmp_path: Path, sdist, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "staged"
    argv = ["stage", "--version", "0.32.0", "--sdist", str(sdist["0.32.0"])]
    assert main([*argv, "--dest", str(dest), "--series-dir", str(SERIES_ROOT)]) == 0
    out = capsys.readouterr().out
    assert "vllm/v1/core/sched/scheduler.py" in out
    assert "footprint:" in out and "existing upstream files" in out
    assert "review size" in out and "the channel's own patches:" in out
    assert "branch hidden-states-v0.32.0" in out
    # Staging again into the same place is refused, not merged into.
    assert main([*argv, "--dest", str(dest)]) == 1


def test_stage_on_a_users_git_checkout(staged_032: StagedTree, tmp_path: Path) -> None:
    checkout = tmp_path / "vllm"
    git(tmp_path, "clone", "-q", "--no-checkout", str(staged_032.repo.path), "vllm")
    git(checkout, "checkout", "-q", "v0.32.0")
    git(checkout, "branch", "-q", "-D", "hidden-states-v0.32.0")  # cloned along
    staged = stage("0.32.0", source=checkout, series_root=SERIES_ROOT)
    assert staged.repo.path == checkout.resolve()
    # The same content as the sdist staging (commit ids differ: committer dates).
    assert git(checkout, "rev-parse", "HEAD^{tree}") == git(
        staged_032.repo.path, "rev-parse", "hidden-states-v0.32.0^{tree}"
    )
    with pytest.raises(VllmHsError, match="already has a branch"):
        stage("0.32.0", source=checkout, series_root=SERIES_ROOT)


def test_release_bump_stops_on_the_known_conflicts(tmp_path: Path, sdist) -> None:
    """0.32.0's series onto 0.33.0: git's three-way merge stops at the Triton
    kernel-override fix (0005), whose test file 0.33.0 changed."""
    outcome = port(
        "0.32.0",
        "0.33.0",
        dest=tmp_path / "bump",
        sdist=sdist["0.33.0"],
        from_sdist=sdist["0.32.0"],
        series_root=SERIES_ROOT,
    )
    assert outcome.conflict is not None
    assert "UU tests/model_executor/test_triton_dispatcher.py" in outcome.conflict
    with pytest.raises(VllmHsError, match="middle of a rebase"):
        refresh(outcome.repo.path, series_root=tmp_path / "patches")


def test_refresh_of_an_untouched_branch_is_byte_identical(
    staged_032: StagedTree, tmp_path: Path
) -> None:
    root = tmp_path / "patches"
    shutil.copytree(SERIES_ROOT / "v0.32.0", root / "v0.32.0")
    outcome = refresh(staged_032.repo.path, series_root=root)
    assert outcome.changed == () and outcome.removed == ()
    for path in (SERIES_ROOT / "v0.32.0").iterdir():
        assert (root / "v0.32.0" / path.name).read_bytes() == path.read_bytes()


def test_refresh_after_an_edit_rewrites_that_patch_and_keeps_headers(
    tmp_path: Path, sdist
) -> None:
    staged = stage(
        "0.32.0", dest=tmp_path / "edit", sdist=sdist["0.32.0"], series_root=SERIES_ROOT
    )
    tree = staged.repo.path
    # A file only one patch touches (an edit of a file later patches touch too
    # changes their index lines as well).
    params = tree / "vllm/sampling_params.py"
    (owner,) = [
        p.name
        for p in staged.series.patches
        if "a/vllm/sampling_params.py" in p.path.read_text()
    ]
    target = git(tree, "log", "--format=%H", "-1", "--", "vllm/sampling_params.py")
    params.write_text(params.read_text() + "\n# An edit made on the branch.\n")
    git(tree, "commit", "-qa", f"--fixup={target.strip()}")
    git(tree, "rebase", "-q", "-i", "--autosquash", "v0.32.0")
    # A commit message that lost its header fields gets them back.
    first = git(tree, "rev-list", "--reverse", "v0.32.0..HEAD").split()[0]
    git(tree, "checkout", "-q", first)
    message = git(tree, "log", "-1", "--format=%B")
    stripped = "\n".join(
        line for line in message.splitlines() if "Upstream-Status" not in line
    )
    git(tree, "commit", "-q", "--amend", "-m", stripped)
    git(tree, "rebase", "-q", "--onto", "HEAD", first, "hidden-states-v0.32.0")

    root = tmp_path / "patches"
    shutil.copytree(SERIES_ROOT / "v0.32.0", root / "v0.32.0")
    outcome = refresh(tree, series_root=root)

    edited = [name for name in outcome.changed]
    assert edited == [owner]
    text = (root / "v0.32.0" / edited[0]).read_text()
    assert "+# An edit made on the branch." in text
    first_patch = sorted((root / "v0.32.0").glob("0001-*.patch"))[0]
    assert (
        first_patch.read_bytes()
        == (SERIES_ROOT / "v0.32.0" / first_patch.name).read_bytes()
    )
    statuses = {
        patch.name: patch.headers["Upstream-Status"]
        for patch in load_series(SERIES_ROOT, "0.32.0").patches
    }
    for path in (root / "v0.32.0").glob("*.patch"):
        body = path.read_text().split("\n---\n", 1)[0]
        status = statuses[path.name]
        assert body.endswith(f"Upstream-Status: {status}\nvLLM-Version: 0.32.0")
    assert (
        load_series(root, "0.32.0").revision
        == load_series(SERIES_ROOT, "0.32.0").revision
    )
