"""vllm-hs apply: all-or-nothing application of a patch series to a vllm/ tree."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vllm_hs.cli import main
from vllm_hs.errors import VllmHsError
from vllm_hs.series import apply as apply_module
from vllm_hs.series import model as series_module
from vllm_hs.series.apply import apply_series
from vllm_hs.series.model import (
    MARKER_FILE,
    load_series,
    read_marker,
    sha256_file,
    unlisted_patches,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import SeriesBuilder

    Snapshot = Callable[[Path], dict]

REAL_SERIES_ROOT = Path(__file__).resolve().parents[2] / "patches"
NEW_MODULE = "vllm/v1/hidden_states/__init__.py"


@pytest.fixture
def series_root(two_patch_series: SeriesBuilder, tmp_path: Path) -> Path:
    two_patch_series.write_series(tmp_path / "patches", revision=4)
    return tmp_path / "patches"


@pytest.fixture
def tree(two_patch_series: SeriesBuilder, tmp_path: Path) -> Path:
    return two_patch_series.make_tree(tmp_path / "site-packages")


def test_apply_patches_files_and_writes_marker(
    two_patch_series: SeriesBuilder, series_root: Path, tree: Path
) -> None:
    outcome = apply_series(tree, series_root)

    for path in ("vllm/sampling_params.py", "vllm/outputs.py", NEW_MODULE):
        assert (tree / path).read_text() == two_patch_series.patched_text(path)
    assert set(outcome.changed_paths) == {
        "vllm/sampling_params.py",
        "vllm/outputs.py",
        NEW_MODULE,
    }
    marker = json.loads((tree / MARKER_FILE).read_text())
    series = load_series(series_root, "0.32.0")
    assert marker["series"] == "v0.32.0"
    assert marker["revision"] == 4
    assert marker["patches"] == [
        {"name": p.name, "sha256": p.sha256} for p in series.patches
    ]
    assert marker["files"] == {
        path: sha256_file(tree / path) for path in outcome.changed_paths
    }


def test_unit_tests_of_the_series_go_into_source_trees_only(
    series_builder: SeriesBuilder, tmp_path: Path
) -> None:
    """A patch that adds a vLLM unit test (tests/...) beside its module: an
    install (site-packages, a wheel) gets the module only, a source tree both."""
    test_file = "tests/v1/hidden_states/test_channel.py"
    series_builder.commit(
        "Add a module and its unit test",
        {NEW_MODULE: "CHANNEL = 1\n", test_file: "def test_channel(): pass\n"},
    )
    root = tmp_path / "patches"
    series_builder.write_series(root)

    installed = series_builder.make_tree(tmp_path / "site-packages")
    outcome = apply_series(installed, root)
    assert (installed / NEW_MODULE).is_file()
    assert not (installed / "tests").exists()
    assert test_file not in json.loads((installed / MARKER_FILE).read_text())["files"]
    assert outcome.changed_paths == (NEW_MODULE,)

    source = series_builder.make_tree(tmp_path / "checkout")
    (source / "pyproject.toml").write_text("[project]\nname = 'vllm'\n")
    (source / "tests").mkdir()
    apply_series(source, root)
    assert (source / test_file).read_text() == "def test_channel(): pass\n"


def test_check_changes_nothing(
    series_root: Path, tree: Path, snapshot: Snapshot
) -> None:
    before = snapshot(tree)
    outcome = apply_series(tree, series_root, check=True)
    assert outcome.marker is None
    assert len(outcome.changed_paths) == 3
    assert snapshot(tree) == before


def test_failing_third_patch_leaves_tree_byte_identical(
    two_patch_series: SeriesBuilder, tmp_path: Path, snapshot: Snapshot
) -> None:
    two_patch_series.commit(
        "Touch init", {"vllm/__init__.py": "HIDDEN_STATES = True\n"}
    )
    series_root = tmp_path / "patches"
    two_patch_series.write_series(series_root)
    tree = two_patch_series.make_tree(tmp_path / "site-packages")
    # The tree's vllm/__init__.py is not what patch 3 expects; patches 1-2 still fit.
    (tree / "vllm/__init__.py").write_text("# locally modified\n")
    before = snapshot(tree)

    with pytest.raises(VllmHsError, match=r"0003-Touch-init\.patch does not apply"):
        apply_series(tree, series_root)
    assert snapshot(tree) == before

    with pytest.raises(VllmHsError, match="does not apply"):
        apply_series(tree, series_root, check=True)
    assert snapshot(tree) == before


def test_failure_while_writing_rolls_back(
    series_root: Path, tree: Path, monkeypatch: pytest.MonkeyPatch, snapshot: Snapshot
) -> None:
    before = snapshot(tree)
    real_sync = apply_module._sync_file
    calls = []

    def sync_then_fail(source: Path, target: Path, created: list[Path]) -> None:
        calls.append(target)
        if len(calls) == 3:
            raise OSError("disk full")
        real_sync(source, target, created)

    monkeypatch.setattr(apply_module, "_sync_file", sync_then_fail)
    with pytest.raises(OSError, match="disk full"):
        apply_series(tree, series_root)
    assert snapshot(tree) == before


def test_reverse_restores_original(
    series_root: Path, tree: Path, snapshot: Snapshot
) -> None:
    before = snapshot(tree)
    apply_series(tree, series_root)
    assert snapshot(tree) != before

    apply_series(tree, series_root, reverse=True, check=True)
    assert (tree / MARKER_FILE).exists()
    apply_series(tree, series_root, reverse=True)
    assert snapshot(tree) == before  # marker and new folders gone too


def test_reverse_of_unpatched_tree_fails_and_changes_nothing(
    series_root: Path, tree: Path, snapshot: Snapshot
) -> None:
    before = snapshot(tree)
    with pytest.raises(VllmHsError, match="cannot be removed"):
        apply_series(tree, series_root, reverse=True)
    assert snapshot(tree) == before


def test_already_patched_tree_is_refused(series_root: Path, tree: Path) -> None:
    apply_series(tree, series_root)
    with pytest.raises(VllmHsError, match="already patched.*revision 4"):
        apply_series(tree, series_root)


def test_reverse_with_a_different_series_is_refused(
    two_patch_series: SeriesBuilder, series_root: Path, tree: Path, tmp_path: Path
) -> None:
    apply_series(tree, series_root)
    two_patch_series.commit("Another change", {"vllm/__init__.py": "X = 1\n"})
    newer_root = tmp_path / "newer-patches"
    two_patch_series.write_series(newer_root, revision=5)
    with pytest.raises(VllmHsError, match="patch files differ"):
        apply_series(tree, newer_root, reverse=True)


def test_unknown_version_is_refused_with_supported_list(
    series_root: Path, tree: Path
) -> None:
    (series_root / "v0.31.1").mkdir()
    (tree / "vllm/_version.py").write_text("__version__ = version = '0.99.0'\n")
    with pytest.raises(VllmHsError) as error:
        apply_series(tree, series_root)
    assert "vLLM 0.99.0" in str(error.value)
    assert "supported versions: 0.31.1, 0.32.0" in str(error.value)


def test_local_version_part_is_ignored(series_root: Path, tree: Path) -> None:
    (tree / "vllm/_version.py").write_text("__version__ = '0.32.0+cpu'\n")
    assert apply_series(tree, series_root).series.name == "v0.32.0"


def test_missing_or_empty_series_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "patches"
    (root / "v0.32.0").mkdir(parents=True)
    with pytest.raises(VllmHsError, match="series does not exist"):
        load_series(root, "0.32.0")
    (root / "v0.32.0" / "series").write_text("# series, revision 1\n")
    with pytest.raises(VllmHsError, match="lists no patches"):
        load_series(root, "0.32.0")
    (root / "v0.32.0" / "series").write_text("# no number here\n0001-a.patch\n")
    with pytest.raises(VllmHsError, match="revision N"):
        load_series(root, "0.32.0")
    (root / "v0.32.0" / "series").write_text("# revision 1\n0001-a.patch\n")
    with pytest.raises(VllmHsError, match="0001-a.patch does not exist"):
        load_series(root, "0.32.0")


def test_tree_without_vllm_is_refused(tmp_path: Path, series_root: Path) -> None:
    with pytest.raises(VllmHsError, match="does not contain a vllm/"):
        apply_series(tmp_path, series_root)


def test_cli_apply_reports_and_exits(
    series_root: Path, tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["apply", str(tree), "--series-dir", str(series_root)]
    assert main([*args, "--check"]) == 0
    assert "applies cleanly" in capsys.readouterr().out
    assert main(args) == 0
    assert "applied to" in capsys.readouterr().out
    assert main(args) == 1
    assert "vllm-hs apply: error: " in capsys.readouterr().err
    assert main([*args, "--reverse"]) == 0
    assert read_marker(tree) is None


def test_relative_series_dir_and_tree(
    series_root: Path, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree.parent)
    relative_root = series_root.relative_to(tree.parent)
    assert main(["apply", tree.name, "--series-dir", str(relative_root)]) == 0
    assert read_marker(tree) is not None


# The real series in patches/ (skipped while it is empty).


def real_series_or_skip():
    try:
        return load_series(REAL_SERIES_ROOT, "0.32.0")
    except VllmHsError as error:
        pytest.skip(f"no usable real series yet: {error}")


def test_real_series_is_well_formed() -> None:
    series = real_series_or_skip()
    assert unlisted_patches(series) == [], "patches missing from the series file"
    for patch in series.patches:
        assert re.fullmatch(r"\d{4}-[A-Za-z0-9._-]+\.patch", patch.name), patch.name
        text = patch.path.read_text()
        for header in ("From: ", "Date: ", "Subject: "):
            assert f"\n{header}" in text or text.startswith(header), (
                f"{patch.name} has no {header.strip()} header"
            )
        assert patch.headers.get("vLLM-Version") == "0.32.0", patch.name
        assert patch.headers.get("Upstream-Status", "").startswith(
            ("Pending", "Submitted", "Not-for-upstream", "Accepted", "Backport vLLM ")
        ), patch.name
        assert "vllm/_vllm_hs.json" not in patch.touched_paths


def test_real_series_applies_to_pristine_vllm(
    pristine_vllm_tree: Path, snapshot: Snapshot
) -> None:
    real_series_or_skip()
    before = snapshot(pristine_vllm_tree / "vllm")
    outcome = apply_series(pristine_vllm_tree, REAL_SERIES_ROOT, check=True)
    assert outcome.changed_paths
    assert snapshot(pristine_vllm_tree / "vllm") == before


def _fake_package(monkeypatch: pytest.MonkeyPatch, root: Path, packaged: bool) -> None:
    package = root / "vllm_hs"
    (package / "series").mkdir(parents=True)
    (root / "patches").mkdir()
    if packaged:
        (package / "patches").mkdir()
    monkeypatch.setattr(series_module, "__file__", str(package / "series" / "model.py"))


def test_refresh_writes_to_the_source_checkout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_package(monkeypatch, tmp_path, packaged=False)
    assert series_module.writable_series_root() == tmp_path / "patches"


def test_refresh_never_writes_into_an_installed_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A wheel install ships the series inside the package: refresh must not
    write there by default (the next install would silently drop it)."""
    _fake_package(monkeypatch, tmp_path, packaged=True)
    with pytest.raises(VllmHsError, match="--series-dir"):
        series_module.writable_series_root()


def test_series_dir_is_resolved_before_commands_change_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import argparse

    from vllm_hs.command import add_series_dir_option

    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_series_dir_option(parser)
    assert parser.parse_args(["--series-dir", "patches"]).series_dir == (
        tmp_path / "patches"
    )
