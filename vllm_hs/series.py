"""The patch series: one folder per vLLM version, an ordered `series` file, git patches.

Layout (paths relative to the series root, by default the `patches/` folder)::

    v0.32.0/series                 # "# ... revision N" first comment, then patch names
    v0.32.0/0001-some-change.patch # git format-patch: header, `---`, unified git diff

Diff paths are relative to the directory that contains the `vllm/` package: the
site-packages root inside a wheel, or the root of a vLLM source checkout.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from vllm_hs.errors import VllmHsError

SERIES_FILE = "series"
VERSION_FILE = "vllm/_version.py"
MARKER_FILE = "vllm/_vllm_hs.json"

_REVISION_RE = re.compile(r"\brevision\s+(\d+)\b")
_DIFF_GIT_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_HEADER_RE = re.compile(
    r"^(Upstream-Status|vLLM-Version|Upstream-PR|Signed-off-by):[ \t]*(.*)$",
    re.MULTILINE,
)
_SUBJECT_RE = re.compile(r"^Subject: \[PATCH\] (.*(?:\n .*)*)", re.MULTILINE)
_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""")


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    sha256: str
    # Paths (relative to the tree root) that the diff reads or writes, in diff order.
    touched_paths: tuple[str, ...]
    # Header lines of the mail body: DEP-3-style "Upstream-Status", "vLLM-Version",
    # "Upstream-PR" (optional: "separate" marks a fix proposed as its own PR), and
    # the DCO "Signed-off-by" (the last one, if several).
    headers: dict[str, str]


@dataclass(frozen=True)
class Series:
    vllm_version: str
    directory: Path
    revision: int
    patches: tuple[Patch, ...]

    @property
    def name(self) -> str:
        return f"v{self.vllm_version}"

    @property
    def touched_paths(self) -> list[str]:
        """Every path any patch touches, sorted, each once."""
        return sorted({path for patch in self.patches for path in patch.touched_paths})


def default_series_root() -> Path:
    """The series shipped with this vllm-hs: packaged data, else the source checkout."""
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "patches", package_dir.parent / "patches"):
        if candidate.is_dir():
            return candidate
    raise VllmHsError(
        f"no patch series found next to {package_dir}; pass --series-dir DIR "
        "(the folder holding v<version>/series)"
    )


def writable_series_root() -> Path:
    """Where commands that write a series (refresh) write by default: the
    source checkout's patches/, never the copy packaged inside an installed
    vllm-hs (it would be lost on the next install)."""
    package_dir = Path(__file__).resolve().parent
    source = package_dir.parent / "patches"
    if not (package_dir / "patches").is_dir() and source.is_dir():
        return source
    raise VllmHsError(
        f"vllm-hs is installed from a wheel ({package_dir}): its packaged series is "
        "not the place to write; pass --series-dir DIR (e.g. --series-dir patches "
        "from the repository root)"
    )


def available_versions(series_root: Path) -> list[str]:
    """The vLLM versions that have a `v<version>/` folder under series_root."""
    if not series_root.is_dir():
        return []
    versions = [
        entry.name[1:]
        for entry in series_root.iterdir()
        if entry.is_dir() and entry.name.startswith("v")
    ]
    return sorted(versions, key=_version_sort_key)


def load_series(series_root: Path, vllm_version: str) -> Series:
    """Read and validate `v<vllm_version>/series` and the patches it lists."""
    directory = series_root / f"v{vllm_version}"
    if not directory.is_dir():
        supported = ", ".join(available_versions(series_root)) or "none"
        raise VllmHsError(
            f"no patch series for vLLM {vllm_version} in {series_root} "
            f"(supported versions: {supported})"
        )
    series_file = directory / SERIES_FILE
    if not series_file.is_file():
        raise VllmHsError(f"{series_file} does not exist")

    lines = series_file.read_text(encoding="utf-8").splitlines()
    comments = [line for line in lines if line.strip().startswith("#")]
    revision_match = _REVISION_RE.search(comments[0]) if comments else None
    if revision_match is None:
        raise VllmHsError(
            f"{series_file}: the first comment line must say 'revision N', e.g. "
            f"'# vllm-hs series for vLLM {vllm_version}, revision 1'"
        )
    names = [
        line.strip()
        for line in lines
        if line.strip() and not line.strip().startswith("#")
    ]
    if not names:
        raise VllmHsError(f"{series_file} lists no patches")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise VllmHsError(f"{series_file} lists {', '.join(duplicates)} twice")

    return Series(
        vllm_version=vllm_version,
        directory=directory,
        revision=int(revision_match.group(1)),
        patches=tuple(_load_patch(directory / name) for name in names),
    )


def unlisted_patches(series: Series) -> list[str]:
    """`*.patch` files in the series folder that the series file does not list."""
    listed = {patch.name for patch in series.patches}
    return sorted(
        path.name
        for path in series.directory.glob("*.patch")
        if path.name not in listed
    )


def read_tree_version(tree: Path) -> str:
    """The vLLM version of a tree (from `vllm/_version.py`), without its local part."""
    version_file = tree / VERSION_FILE
    if not version_file.is_file():
        raise VllmHsError(
            f"{version_file} not found: the tree must be the directory that contains "
            "the vllm/ package (site-packages, an unpacked wheel, or a vLLM source "
            "checkout that has been built once so that _version.py exists)"
        )
    for line in version_file.read_text(encoding="utf-8").splitlines():
        match = _VERSION_RE.match(line.strip())
        if match:
            return match.group(1).split("+", 1)[0]
    raise VllmHsError(f"{version_file} has no __version__ assignment")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_patch(path: Path) -> Patch:
    if not path.is_file():
        raise VllmHsError(f"the series lists {path.name}, but {path} does not exist")
    text = path.read_text(encoding="utf-8")
    touched: list[str] = []
    for match in _DIFF_GIT_RE.finditer(text):
        for candidate in match.groups():
            _check_relative(candidate, path)
            if candidate not in touched:
                touched.append(candidate)
    if not touched:
        raise VllmHsError(f"{path} holds no 'diff --git a/... b/...' section")
    return Patch(
        name=path.name,
        path=path,
        sha256=sha256_file(path),
        touched_paths=tuple(touched),
        headers=patch_headers(text),
    )


def patch_headers(text: str) -> dict[str, str]:
    """The DEP-3-style fields (Upstream-Status, vLLM-Version) of a patch's message."""
    body = text.split("\ndiff --git ", 1)[0]
    return {key: value.strip() for key, value in _HEADER_RE.findall(body)}


def patch_subject(text: str) -> str | None:
    """The subject of a `git format-patch` mail, unwrapped; None if it has none."""
    match = _SUBJECT_RE.search(text)
    return " ".join(match.group(1).split()) if match else None


def _check_relative(diff_path: str, patch_path: Path) -> None:
    pure = PurePosixPath(diff_path)
    if pure.is_absolute() or ".." in pure.parts:
        raise VllmHsError(f"{patch_path}: unsafe path {diff_path!r} in diff")


def _version_sort_key(version: str) -> tuple[int, tuple[int, ...], str]:
    numbers = tuple(int(part) for part in re.findall(r"\d+", version))
    return (0, numbers, version) if numbers else (1, (), version)
