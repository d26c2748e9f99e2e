"""The patch series: one folder per vLLM version, an ordered `series` file, git patches.

Layout (paths relative to the series root, by default the `patches/` folder)::

    v0.32.0/series                 # "# ... revision N" first comment, then patch names
    v0.32.0/0001-some-change.patch # git format-patch: header, `---`, unified git diff

Diff paths are relative to the directory that contains the `vllm/` package: the
site-packages root inside a wheel, or the root of a vLLM source checkout.

A patch file is read once, by `PatchMail.parse`: the mail with the stdlib `email`
parser, its trailers with `git interpret-trailers`, its diff with `unidiff`. The
marker `vllm/_vllm_hs.json` that `vllm-hs apply` writes is a `Marker`.
"""

from __future__ import annotations

import email
import email.policy
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from unidiff import PatchSet

from vllm_hs.errors import VllmHsError
from vllm_hs.series.git import parse_trailers

SERIES_FILE = "series"
VERSION_FILE = "vllm/_version.py"
MARKER_FILE = "vllm/_vllm_hs.json"
# The trailers the series reads (DEP-3 style, plus the DCO sign-off).
HEADER_FIELDS = ("Upstream-Status", "vLLM-Version", "Upstream-PR", "Signed-off-by")

_REVISION_RE = re.compile(r"\brevision\s+(\d+)\b")
_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""")
_SUBJECT_PREFIX = "[PATCH] "
_NO_FILE = "/dev/null"


@dataclass(frozen=True)
class PatchMail:
    """One `git format-patch` mail, parsed.

    Invariants: `message` is the mail body before the `---` line that starts the
    diffstat (the commit message less its subject), `diff` what follows that
    line; `trailers` are the trailers of `message`'s last paragraph, in order.
    """

    # The subject, unfolded, without "[PATCH] "; None when the mail has no
    # "Subject: [PATCH] ..." header (not git format-patch output).
    subject: str | None
    message: str
    diff: str
    trailers: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> PatchMail:
        mail = email.message_from_string(text, policy=email.policy.default)
        raw = mail["Subject"]
        subject = None
        if raw is not None and str(raw).startswith(_SUBJECT_PREFIX):
            subject = " ".join(str(raw)[len(_SUBJECT_PREFIX) :].split())
        payload = mail.get_payload()
        body = payload if isinstance(payload, str) else ""
        if body.startswith("---\n"):
            message, diff = "", body[len("---\n") :]
        else:
            message, _, diff = body.partition("\n---\n")
        trailers = tuple(parse_trailers(message + "\n")) if message.strip() else ()
        return cls(subject, message, diff, trailers)

    @property
    def headers(self) -> dict[str, str]:
        """The HEADER_FIELDS among the trailers (the last one of a repeated key)."""
        return {key: value for key, value in self.trailers if key in HEADER_FIELDS}

    def touched_paths(self) -> list[str]:
        """Paths (relative to the tree root) the diff reads or writes, in diff
        order: per file, its old path, then its new one (absent for /dev/null)."""
        paths = []
        for patched in PatchSet(self.diff):
            for name, prefix in (
                (patched.source_file, "a/"),
                (patched.target_file, "b/"),
            ):
                if name != _NO_FILE:
                    paths.append(name.removeprefix(prefix))
        return paths


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    sha256: str
    # Paths (relative to the tree root) that the diff reads or writes, in diff order,
    # each once; none absolute or with "..".
    touched_paths: tuple[str, ...]
    # Trailers of the commit message: DEP-3-style "Upstream-Status", "vLLM-Version",
    # "Upstream-PR" (optional: "separate" marks a fix proposed as its own PR), and
    # the DCO "Signed-off-by" (the last one, if several).
    headers: dict[str, str]
    # The parsed file (subject, message, diff, every trailer).
    mail: PatchMail = field(repr=False, compare=False)


@dataclass(frozen=True)
class Series:
    vllm_version: str
    directory: Path  # <series root>/v<vllm_version>
    revision: int  # the N of "revision N" in the series file; the +hs.N of wheels
    # In series-file order; names unique, every file exists.
    patches: tuple[Patch, ...]

    @property
    def name(self) -> str:
        return f"v{self.vllm_version}"

    @property
    def touched_paths(self) -> list[str]:
        """Every path any patch touches, sorted, each once."""
        return sorted({path for patch in self.patches for path in patch.touched_paths})


@dataclass(frozen=True)
class PatchDigest:
    name: str  # the patch file's name
    sha256: str  # of the patch file


@dataclass(frozen=True)
class Marker:
    """`vllm/_vllm_hs.json`: which series `vllm-hs apply` applied to a tree.

    Its JSON (`dumps`) is that of every vllm-hs so far (installed wheels carry
    the file): keys series, revision, vllm_hs_version, patches, files, in that
    order, indented by 2.
    """

    series: str  # the series name, "v<vLLM version>"
    revision: int
    vllm_hs_version: str  # the vllm-hs that applied it
    # Every patch of the series, in series order.
    patches: tuple[PatchDigest, ...]
    # Path (relative to the tree) -> sha256 of every file the series touches that
    # exists after applying it (a deleted file is absent).
    files: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "series": self.series,
            "revision": self.revision,
            "vllm_hs_version": self.vllm_hs_version,
            "patches": [{"name": p.name, "sha256": p.sha256} for p in self.patches],
            "files": dict(self.files),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def loads(cls, text: str | bytes, source: str) -> Marker:
        """The marker in JSON text; `source` names it in errors."""
        try:
            value = json.loads(text)
        except ValueError as error:
            raise VllmHsError(f"{source} is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise VllmHsError(f"{source} does not hold a JSON object")
        try:
            return cls(
                series=str(value["series"]),
                revision=int(value["revision"]),
                vllm_hs_version=str(value["vllm_hs_version"]),
                patches=tuple(
                    PatchDigest(str(p["name"]), str(p["sha256"]))
                    for p in value["patches"]
                ),
                files={str(k): str(v) for k, v in dict(value["files"]).items()},
            )
        except (KeyError, TypeError, ValueError) as error:
            raise VllmHsError(f"{source} is not a vllm-hs marker: {error!r}") from None


def read_marker(tree: Path) -> Marker | None:
    """The marker of tree (None when the tree is not patched)."""
    path = tree / MARKER_FILE
    if not path.is_file():
        return None
    return Marker.loads(path.read_text(encoding="utf-8"), str(path))


def default_series_root() -> Path:
    """The series shipped with this vllm-hs: packaged data, else the source checkout."""
    package_dir = Path(__file__).resolve().parents[1]  # vllm_hs/
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
    package_dir = Path(__file__).resolve().parents[1]  # vllm_hs/
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
    return sorted(versions, key=version_sort_key)


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
    mail = PatchMail.parse(path.read_text(encoding="utf-8"))
    touched: list[str] = []
    for candidate in mail.touched_paths():
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
        headers=mail.headers,
        mail=mail,
    )


def _check_relative(diff_path: str, patch_path: Path) -> None:
    pure = PurePosixPath(diff_path)
    if pure.is_absolute() or ".." in pure.parts:
        raise VllmHsError(f"{patch_path}: unsafe path {diff_path!r} in diff")


def version_sort_key(version: str) -> tuple[int, tuple[int, ...], str]:
    numbers = tuple(int(part) for part in re.findall(r"\d+", version))
    return (0, numbers, version) if numbers else (1, (), version)
