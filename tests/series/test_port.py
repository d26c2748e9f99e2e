"""`vllm-hs port` on small synthetic releases: a git checkout with the tags v0.1.0
and v0.2.0, and a four-patch series for 0.1.0 whose patches meet every fate: one
applies clean, one is merged around an upstream change, one is already upstream
(dropped), one conflicts and is resolved by hand."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from vllm_hs.cli import main
from vllm_hs.errors import VllmHsError
from vllm_hs.series.git import Repo
from vllm_hs.series.model import load_series
from vllm_hs.series.port import (
    PortState,
    abort,
    finish,
    parse_hunks,
    port,
    resume,
    to_old_line,
)
from vllm_hs.series.refresh import FORMAT_PATCH_OPTIONS, refresh
from vllm_hs_testing.git import git_env

GIT_ENV = git_env()

CONFIG = "".join(f"setting_{i} = {i}\n" for i in range(30))
V1 = {
    "vllm/_version.py": "__version__ = '0.1.0'\n",
    "vllm/outputs.py": "class CompletionOutput:\n    text = ''\n",
    "vllm/config.py": CONFIG,
    "vllm/utils.py": "def clamp(x):\n    return x\n",
}
# 0.2.0 changes three lines near patch 2's (not its own), makes patch 3's fix
# itself, and changes the line patch 4 changes, differently.
V2 = {
    "vllm/_version.py": "__version__ = '0.2.0'\n",
    "vllm/config.py": CONFIG.replace("setting_3 = 3", "setting_3 = 33").replace(
        "setting_20 = 20", "setting_20 = 'upstream'"
    ),
    "vllm/utils.py": "def clamp(x):\n    return max(x, 0)\n",
}
PATCHES = [
    ("[Core] Outputs carry hidden states", {"vllm/outputs.py": V1["vllm/outputs.py"]
     + "    hidden_states = None\n"}),
    ("[Core] A setting for hidden states", {"vllm/config.py": CONFIG.replace(
        "setting_5 = 5\n", "setting_5 = 5\nhidden_states = None\n")}),
    ("[Bugfix] clamp at zero", {"vllm/utils.py": V2["vllm/utils.py"]}),
    ("[Core] Setting 20 for the channel", {"vllm/config.py": CONFIG.replace(
        "setting_5 = 5\n", "setting_5 = 5\nhidden_states = None\n").replace(
        "setting_20 = 20", "setting_20 = 'channel'")}),
]  # fmt: skip


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout


def write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


@pytest.fixture
def releases(tmp_path: Path) -> tuple[Path, Path]:
    """(a vLLM checkout with tags v0.1.0 and v0.2.0, a series root holding the
    0.1.0 series)."""
    checkout = tmp_path / "vllm"
    checkout.mkdir()
    git(checkout, "init", "-q", "-b", "main")
    write(checkout, V1)
    git(checkout, "add", "-A")
    git(checkout, "commit", "-q", "-m", "vLLM 0.1.0")
    git(checkout, "tag", "v0.1.0")
    git(checkout, "checkout", "-q", "-b", "series")
    for subject, files in PATCHES:
        write(checkout, files)
        message = f"{subject}\n\nWhy.\n\nUpstream-Status: Pending\nvLLM-Version: 0.1.0"
        git(checkout, "commit", "-qam", message)
    root = tmp_path / "patches"
    directory = root / "v0.1.0"
    out = git(
        checkout, "format-patch", *FORMAT_PATCH_OPTIONS, "-o", str(directory),
        "v0.1.0..series",
    )  # fmt: skip
    names = [Path(line).name for line in out.split()]
    lines = ["# vllm-hs series for vLLM 0.1.0, revision 3", "# A comment.", *names]
    (directory / "series").write_text("\n".join(lines) + "\n")
    git(checkout, "checkout", "-q", "main")
    git(checkout, "branch", "-q", "-D", "series")
    write(checkout, V2)
    git(checkout, "commit", "-qam", "vLLM 0.2.0: clamp at zero, settings 3 and 20")
    git(checkout, "tag", "v0.2.0")
    return checkout, root


def _start(checkout: Path, root: Path):
    return port("0.1.0", "0.2.0", source=checkout, series_root=root)


def test_port_stops_on_a_conflict_with_a_report_then_continues(
    releases: tuple[Path, Path],
) -> None:
    checkout, root = releases
    outcome = _start(checkout, root)
    assert outcome is not None and outcome.conflict is not None
    report = outcome.conflict
    state = outcome.state
    names = load_series(root, "0.1.0").patches
    stopped = names[3].name
    assert state.stopped == stopped
    assert state.fates == {
        names[0].name: "clean",
        names[1].name: "merged",
        names[2].name: "dropped",
    }
    assert f"{stopped} (4 of 4)" in report
    assert "UU vllm/config.py" in report
    # The patch's hunk, and upstream's change to those lines (not the one near
    # patch 2's line, 15 lines away).
    patch_part, upstream_part = report.split("upstream's changes to those lines")
    assert "+setting_20 = 'channel'" in patch_part
    assert "+setting_20 = 'upstream'" in upstream_part
    assert "setting_3 = 33" not in upstream_part
    assert "vLLM 0.2.0: clamp at zero" in upstream_part  # the commits, from git log
    assert "vllm-hs port --continue --tree" in report
    with pytest.raises(VllmHsError, match="middle of a rebase, am or cherry-pick"):
        refresh(checkout, series_root=root)
    with pytest.raises(VllmHsError, match="unresolved conflicts"):
        resume(Repo(checkout))

    config = checkout / "vllm/config.py"
    resolved = V2["vllm/config.py"].replace(
        "setting_5 = 5\n", "setting_5 = 5\nhidden_states = None\n"
    )
    config.write_text(resolved.replace("'upstream'", "'upstream and channel'"))
    git(checkout, "add", "vllm/config.py")
    assert main(["port", "--continue", "--tree", str(checkout)]) == 0

    ported = load_series(root, "0.2.0")
    assert [p.mail.subject for p in ported.patches] == [
        PATCHES[0][0], PATCHES[1][0], PATCHES[3][0]
    ]  # fmt: skip
    assert ported.revision == 1
    series_text = (ported.directory / "series").read_text()
    assert series_text.startswith("# vllm-hs series for vLLM 0.2.0, revision 1\n")
    assert "# A comment.\n" in series_text
    for patch in ported.patches:
        assert patch.headers["vLLM-Version"] == "0.2.0"
        assert patch.headers["Upstream-Status"] == "Pending"
    assert "'upstream and channel'" in ported.patches[2].path.read_text()
    # Byte-stable: writing the branch again changes nothing.
    again = refresh(checkout, series_root=root)
    assert again.changed == () and again.removed == ()
    # The port is over: no state is left to continue or abort.
    with pytest.raises(VllmHsError, match="no port in progress"):
        PortState.load(Repo(checkout))


def test_port_cli_summary_and_abort(
    releases: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    checkout, root = releases
    argv = ["port", "--from", "0.1.0", "--to", "0.2.0", "--source", str(checkout)]
    assert main([*argv, "--series-dir", str(root)]) == 1
    out = capsys.readouterr().out
    assert "does not apply cleanly to vLLM 0.2.0" in out
    for fate in ("clean", "merged", "dropped", "stopped"):
        assert f"  {fate} " in out
    assert main(["port", "--abort", "--tree", str(checkout)]) == 0
    assert "hidden-states-v0.2.0" not in git(checkout, "branch")
    assert git(checkout, "status", "--porcelain", "--untracked-files=no") == ""
    with pytest.raises(VllmHsError, match="no port in progress"):
        resume(Repo(checkout))
    with pytest.raises(VllmHsError, match="no port in progress"):
        abort(Repo(checkout))
    assert not (root / "v0.2.0").exists()


def test_a_patch_resolved_to_nothing_is_dropped(releases: tuple[Path, Path]) -> None:
    checkout, root = releases
    outcome = _start(checkout, root)
    assert outcome is not None and outcome.conflict is not None
    # Keep upstream's side: the patch's change is given up.
    git(checkout, "checkout", "--ours", "vllm/config.py")
    git(checkout, "add", "vllm/config.py")
    done = resume(Repo(checkout))
    assert done.conflict is None
    assert done.state.fates[done.state.patches[3]] == "dropped"
    assert "dropped" in done.summary()


def test_old_lines_of_new_lines() -> None:
    # A diff that inserts two lines after line 3 and removes line 10.
    diff = "@@ -3,0 +4,2 @@\n+a\n+b\n@@ -10 +11,0 @@\n-c\n"
    hunks = parse_hunks(diff)
    assert [(h.old_start, h.old_len, h.new_start, h.new_len) for h in hunks] == [
        (3, 0, 4, 2),
        (10, 1, 11, 0),
    ]
    assert to_old_line(2, hunks) == 2
    assert to_old_line(7, hunks) == 5
    assert to_old_line(20, hunks) == 19


def test_a_port_onto_a_release_with_a_series_of_its_own(
    releases: tuple[Path, Path],
) -> None:
    # X already has a series of an older design: the port replaces it with V's
    # series carried over, as X's next revision, with V's comments.
    checkout, root = releases
    old = root / "v0.2.0"
    old.mkdir()
    first = load_series(root, "0.1.0").patches[0]
    (old / "0001-Old.patch").write_text(first.path.read_text())
    header = "# vllm-hs series for vLLM 0.2.0, revision 5\n# Old.\n"
    (old / "series").write_text(header + "0001-Old.patch\n")
    outcome = _start(checkout, root)
    assert outcome is not None and outcome.conflict is not None
    git(checkout, "checkout", "--ours", "vllm/config.py")
    git(checkout, "add", "vllm/config.py")
    finish(resume(Repo(checkout)))
    ported = load_series(root, "0.2.0")
    assert ported.revision == 6
    series_text = (ported.directory / "series").read_text()
    assert "# A comment.\n" in series_text and "# Old." not in series_text
    assert not (old / "0001-Old.patch").exists()
    # A later refresh keeps that revision and those comments.
    assert refresh(checkout, series_root=root).changed == ()
    assert (ported.directory / "series").read_text() == series_text
