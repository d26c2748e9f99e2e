"""The git repository `stage` and `port` work in, and `refresh`'s write-back.

What the three commands share, so that none of them imports another:

- `prepare_tree`: a repository holding vLLM X's source release (tag `v<X>`) and,
  for a release bump, V's under it (tag `v<V>`), with a series applied as one
  commit per patch (`git am`) on a branch at `v<V>`, and the staging recorded in
  the repository's git config;
- `refresh`: the commits of the checked-out branch written back as the series
  `patches/v<X>/` (byte-stable `git format-patch`, headers kept).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_hs.errors import VllmHsError
from vllm_hs.fs import atomic_write_text
from vllm_hs.series.git import GitError, Repo, add_trailers
from vllm_hs.series.model import (
    SERIES_FILE,
    PatchMail,
    Series,
    load_series,
    sha256_file,
    writable_series_root,
)
from vllm_hs.series.sdist import fetch_sdist, unpack_sdist

CONFIG_VERSION = "vllm-hs.version"
CONFIG_BASE = "vllm-hs.base"
CONFIG_BRANCH = "vllm-hs.branch"
# The release whose series the branch was made from (differs from X in a bump).
CONFIG_FROM = "vllm-hs.from"

# A fixed abbreviation: git's default grows with the number of objects in the
# repository, so the same branch would give other index lines in another clone.
FORMAT_PATCH_OPTIONS = (
    "--zero-commit",
    "--no-signature",
    "--no-numbered",
    "--abbrev=12",
)
# The trailers refresh writes itself (any earlier copy in the message is dropped),
# and the sign-off, which stage adds for the person staging.
_OWN_FIELDS = ("Upstream-Status:", "vLLM-Version:", "Signed-off-by:")


def prepare_tree(
    version: str,
    series: Series,
    *,
    series_branch: str,
    branch: str,
    dest: Path | None = None,
    source: Path | None = None,
    sdist: Path | None = None,
    series_sdist: Path | None = None,
) -> Repo:
    """The repository of release `version` (X) with `series` (of release V, X or
    an older one) applied as commits on `series_branch`, made at tag v<V>.

    From `source` (a clean git checkout with the tags v<X> and v<V>), else a new
    repository at `dest` (default ./vllm-<X>) holding the sdist of V (`series_sdist`,
    default: downloaded) and X's (`sdist`) on top. `branch` is where the result is
    to live (`series_branch` itself for a stage; the port's branch in a bump); both
    must be new."""
    series_version = series.vllm_version
    base, series_base = f"v{version}", f"v{series_version}"
    if source is not None:
        repo = Repo(source.resolve())
        if not repo.is_repo():
            raise VllmHsError(f"{source} is not a git checkout")
        if not repo.is_clean():
            raise VllmHsError(f"{source} has uncommitted changes; commit or stash")
        for tag in {base, series_base}:
            if repo.rev(tag) is None:
                raise VllmHsError(f"{source} has no tag {tag} (git fetch --tags?)")
    else:
        dest = (dest or Path(f"vllm-{version}")).resolve()
        if dest.exists():
            raise VllmHsError(f"{dest} already exists; remove it or pass --dest")
        repo = Repo.init(dest)
        try:
            if series_base != base:
                import_release(repo, series_version, series_sdist)
            parent = series_base if series_base != base else None
            import_release(repo, version, sdist, parent=parent)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)  # no half-made repository
            raise

    for name in {branch, series_branch}:
        if repo.rev(f"refs/heads/{name}") is not None:
            raise VllmHsError(f"{repo.path} already has a branch {name}; pass --branch")
    repo.git("checkout", "-q", "-b", series_branch, series_base)
    apply_commits(repo, series)
    repo.config_set(CONFIG_VERSION, version)
    repo.config_set(CONFIG_BASE, base)
    repo.config_set(CONFIG_BRANCH, branch)
    repo.config_set(CONFIG_FROM, series_version)
    return repo


def import_release(
    repo: Repo, version: str, sdist: Path | None = None, parent: str | None = None
) -> str:
    """Commit vLLM `version`'s sdist (on `parent`, else as a root) and tag it v<X>."""
    tag = f"v{version}"
    archive = sdist if sdist is not None else fetch_sdist(version)
    if parent is not None:
        repo.git("checkout", "-q", "--detach", parent)
    for entry in repo.path.iterdir():
        if entry.name == ".git":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    with tempfile.TemporaryDirectory(dir=repo.path.parent) as scratch:
        unpacked = unpack_sdist(archive, Path(scratch) / "src")
        for entry in unpacked.iterdir():
            entry.rename(repo.path / entry.name)
    repo.commit_all(
        f"vLLM {version}\n\nThe source release {archive.name}, "
        f"sha256 {sha256_file(archive)}, imported by vllm-hs stage."
    )
    repo.git("tag", tag)
    return tag


def apply_commits(repo: Repo, series: Series) -> None:
    """`git am` every patch of the series, in order, onto the checked-out branch."""
    for patch in series.patches:
        try:
            repo.am(patch.path)
        except GitError as error:
            raise VllmHsError(
                f"{patch.name} does not apply to {repo.path}:\n{error.output}"
            ) from None


# -- the write-back ---------------------------------------------------------------


@dataclass(frozen=True)
class RefreshOutcome:
    directory: Path  # <series root>/v<X>
    written: tuple[str, ...]  # every patch of the new series, in series order
    changed: tuple[str, ...]  # those whose file content changed (or is new)
    removed: tuple[str, ...]  # patch files of the old series deleted


def refresh(
    tree: Path,
    *,
    series_root: Path | None = None,
    version: str | None = None,
    base: str | None = None,
    revision: int | None = None,
    origin: str | None = None,
) -> RefreshOutcome:
    """Write patches/v<X>/ from the branch. The comments and each patch's
    Upstream-Status come from `origin`'s series (a port: the series carried
    over), else X's own, else the one the branch was staged from."""
    repo = Repo(tree.resolve())
    if not repo.is_repo():
        raise VllmHsError(f"{tree} is not a git repository")
    version = version or repo.config_get(CONFIG_VERSION)
    if version is None:
        raise VllmHsError(f"{tree} was not made by vllm-hs stage; pass --version")
    base = base or repo.config_get(CONFIG_BASE) or f"v{version}"
    if repo.rev(base) is None:
        raise VllmHsError(f"{tree} has no {base}")
    if repo.in_progress():
        raise VllmHsError(
            f"{tree} is in the middle of a rebase, am or cherry-pick; finish it first"
        )
    if not repo.is_clean():
        raise VllmHsError(f"{tree} has uncommitted changes; commit them first")
    if repo.git("rev-list", "--merges", f"{base}..HEAD").strip():
        raise VllmHsError(f"{base}..HEAD holds merge commits; a series must be linear")
    if not repo.git("rev-list", f"{base}..HEAD").strip():
        raise VllmHsError(f"HEAD of {tree} has no commits on top of {base}")

    series_root = series_root or writable_series_root()
    directory = series_root / f"v{version}"
    old_patches: dict[str, str] = {}
    # Subject of each old patch -> its Upstream-Status.
    old_status: dict[str | None, str | None] = {}
    comments: list[str] = []
    old_revision: int | None = None
    # The series being replaced: X's own, else (a bump) the one the branch came from.
    if origin is None:
        origin = version
        if not (directory / SERIES_FILE).is_file():
            origin = repo.config_get(CONFIG_FROM) or version
    if (series_root / f"v{origin}" / SERIES_FILE).is_file():
        old = load_series(series_root, origin)
        old_revision = old.revision if origin == version else None
        old_patches = {p.name: p.path.read_text(encoding="utf-8") for p in old.patches}
        old_status = {
            p.mail.subject: p.headers.get("Upstream-Status") for p in old.patches
        }
        comments = [
            line
            for line in (old.directory / SERIES_FILE).read_text().splitlines()
            if line.startswith("#")
        ]

    with tempfile.TemporaryDirectory(prefix="vllm-hs-refresh-") as scratch:
        span = f"{base}..HEAD"
        repo.git("format-patch", "-q", *FORMAT_PATCH_OPTIONS, "-o", scratch, span)
        generated = sorted(Path(scratch).glob("*.patch"))
        texts = {
            path.name: with_headers(
                path.read_text(encoding="utf-8"), version, old_status
            )
            for path in generated
        }

    directory.mkdir(parents=True, exist_ok=True)
    removed = []
    for stale in sorted(directory.glob("*.patch")):
        if stale.name not in texts:
            stale.unlink()
            removed.append(stale.name)
    changed = tuple(name for name in texts if old_patches.get(name) != texts[name])
    for name, text in texts.items():
        atomic_write_text(directory / name, text)

    revision = revision or old_revision or 1
    first = f"# vllm-hs series for vLLM {version}, revision {revision}"
    lines = [first, *comments[1:], *texts]
    atomic_write_text(directory / SERIES_FILE, "\n".join(lines) + "\n")
    load_series(series_root, version)  # what was written must read back
    return RefreshOutcome(directory, tuple(texts), changed, tuple(removed))


def with_headers(
    text: str, version: str, old_status: dict[str | None, str | None]
) -> str:
    """The patch with `Upstream-Status:` kept (or Pending) and `vLLM-Version: X`,
    the last trailers of the message."""
    message, separator, rest = text.partition("\n---\n")
    if not separator:
        raise VllmHsError("format-patch output without a '---' separator")
    mail = PatchMail.parse(text)
    status = mail.headers.get("Upstream-Status") or old_status.get(mail.subject)
    lines = [line for line in message.splitlines() if not line.startswith(_OWN_FIELDS)]
    while lines and not lines[-1].strip():
        lines.pop()
    trailers = [("Upstream-Status", status or "Pending"), ("vLLM-Version", version)]
    message = add_trailers("\n".join(lines) + "\n", trailers).rstrip("\n")
    return message + separator + rest
