"""`vllm-hs wheel --vllm vllm==0.33.0` builds the patched official wheel.

0.33.0 has no CPU build, so the wheel cannot run here: what is checked is that the
real upstream wheel (from PyPI, ~330 MB, cached under $VLLM_HS_CACHE/wheels) takes
the series and comes out as a valid, re-versioned wheel holding the patched files
of the staged 0.33.0 branch, byte for byte.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest

from vllm_hs.cli import main
from vllm_hs.series.model import MARKER_FILE, load_series
from vllm_hs.series.stage import stage

SERIES_ROOT = Path(__file__).resolve().parents[2] / "patches"


@pytest.fixture(scope="module")
def wheel_033(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    argv = ["wheel", "--vllm", "vllm==0.33.0", "--out", str(out)]
    assert main([*argv, "--series-dir", str(SERIES_ROOT)]) == 0
    (built,) = out.glob("*.whl")
    return built


def test_name_version_and_record(wheel_033: Path) -> None:
    revision = load_series(SERIES_ROOT, "0.33.0").revision
    version = f"0.33.0+hs.{revision}"
    assert wheel_033.name.startswith(f"vllm-{version}-cp38-abi3-manylinux")
    with zipfile.ZipFile(wheel_033) as archive:
        metadata = archive.read(f"vllm-{version}.dist-info/METADATA").decode()
        assert f"\nVersion: {version}\n" in metadata
        record = f"vllm-{version}.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(archive.read(record).decode())))
        patched = {
            "vllm/v1/core/sched/scheduler.py",
            "vllm/v1/hidden_states/capture.py",
        }
        for name, digest, _size in rows:
            if name in patched:
                data = archive.read(name)
                raw = hashlib.sha256(data).digest()
                expected = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
                assert digest == f"sha256={expected}"


def test_files_equal_the_staged_branch(wheel_033: Path, tmp_path: Path, sdist) -> None:
    staged = stage(
        "0.33.0", dest=tmp_path / "v033", sdist=sdist["0.33.0"], series_root=SERIES_ROOT
    )
    series = load_series(SERIES_ROOT, "0.33.0")
    with zipfile.ZipFile(wheel_033) as archive:
        marker = json.loads(archive.read(MARKER_FILE))
        assert marker["series"] == "v0.33.0"
        assert [p["sha256"] for p in marker["patches"]] == [
            p.sha256 for p in series.patches
        ]
        # The series' own unit tests (tests/...) stay out of the wheel.
        assert not [n for n in archive.namelist() if n.startswith("tests/")]
        for path in series.touched_paths:
            if path.startswith("vllm/"):
                staged_bytes = (staged.repo.path / path).read_bytes()
                assert archive.read(path) == staged_bytes, path
