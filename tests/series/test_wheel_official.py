"""`vllm-hs wheel --vllm vllm==X` builds the patched official wheel of the
newest release that has a series (0.34.0; it has no CPU build).

Those wheels cannot run here: what is checked is that the real upstream wheel
(from PyPI, ~330 MB, cached under $VLLM_HS_CACHE/wheels) takes the series and
comes out as a valid, re-versioned wheel holding the patched files of the staged
branch, byte for byte.
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
from vllm_hs.series.model import MARKER_FILE, available_versions, load_series
from vllm_hs.series.stage import stage

SERIES_ROOT = Path(__file__).resolve().parents[2] / "patches"
# CI time: the newest release's official wheel (0.32.0, the CPU test base, is
# installed and run by the rest of the suite; an older official wheel was
# checked when its series was made, and `vllm-hs wheel --vllm vllm==X` redoes it).
OFFICIAL = available_versions(SERIES_ROOT)[-1:]


@pytest.fixture(scope="module", params=OFFICIAL)
def wheel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("dist")
    argv = ["wheel", "--vllm", f"vllm=={request.param}", "--out", str(out)]
    assert main([*argv, "--series-dir", str(SERIES_ROOT)]) == 0
    (built,) = out.glob("*.whl")
    return request.param, built


def test_name_version_and_record(wheel: tuple[str, Path]) -> None:
    release, built = wheel
    revision = load_series(SERIES_ROOT, release).revision
    version = f"{release}+hs.{revision}"
    assert built.name.startswith(f"vllm-{version}-cp38-abi3-manylinux")
    with zipfile.ZipFile(built) as archive:
        metadata = archive.read(f"vllm-{version}.dist-info/METADATA").decode()
        assert f"\nVersion: {version}\n" in metadata
        record = f"vllm-{version}.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(archive.read(record).decode())))
        patched = {
            "vllm/v1/core/sched/scheduler.py",
            "vllm/distributed/aux_output_connector/hidden_states.py",
        }
        for name, digest, _size in rows:
            if name in patched:
                data = archive.read(name)
                raw = hashlib.sha256(data).digest()
                expected = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
                assert digest == f"sha256={expected}"


def test_files_equal_the_staged_branch(
    wheel: tuple[str, Path], tmp_path: Path, sdist
) -> None:
    release, built = wheel
    staged = stage(
        release, dest=tmp_path / "tree", sdist=sdist[release], series_root=SERIES_ROOT
    )
    series = load_series(SERIES_ROOT, release)
    with zipfile.ZipFile(built) as archive:
        marker = json.loads(archive.read(MARKER_FILE))
        assert marker["series"] == f"v{release}"
        assert [p["sha256"] for p in marker["patches"]] == [
            p.sha256 for p in series.patches
        ]
        # The series' own unit tests (tests/...) stay out of the wheel.
        assert not [n for n in archive.namelist() if n.startswith("tests/")]
        for path in series.touched_paths:
            if path.startswith("vllm/"):
                staged_bytes = (staged.repo.path / path).read_bytes()
                assert archive.read(path) == staged_bytes, path
