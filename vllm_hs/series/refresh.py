"""`vllm-hs refresh`: write `patches/v<X>/` back from the commits of a staged branch.

The quilt / gbp-pq loop: `vllm-hs stage`, edit the branch (amend, fixup + autosquash,
reorder, add commits), `vllm-hs refresh`. Each commit becomes one patch (`git
format-patch --zero-commit --no-signature --no-numbered --abbrev=12`, so an
unchanged commit gives a byte-identical file, in any clone). The DEP-3-style
header fields stay: a commit whose message lost `Upstream-Status:` gets the one
its patch had (matched by subject), else `Pending`; `vLLM-Version:` is set to X,
the release the branch is on. `Signed-off-by:` trailers are dropped (stage adds
the sign-off of whoever stages the series); others (`Upstream-PR:`) are kept as
they are in the commit.
The series file keeps its comment lines and revision unless --revision says
otherwise.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_hs.command import EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.fs import atomic_write_text
from vllm_hs.series.git import Repo, add_trailers
from vllm_hs.series.model import (
    SERIES_FILE,
    PatchMail,
    load_series,
    writable_series_root,
)
from vllm_hs.series.stage import CONFIG_BASE, CONFIG_FROM, CONFIG_VERSION

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


@dataclass(frozen=True)
class RefreshOutcome:
    directory: Path  # <series root>/v<X>
    written: tuple[str, ...]  # every patch of the new series, in series order
    changed: tuple[str, ...]  # those whose file content changed (or is new)
    removed: tuple[str, ...]  # patch files of the old series deleted


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "refresh",
        help="regenerate patches/v<X>/ from the commits of a staged branch",
        description=(
            "Regenerate the series of the branch checked out in TREE (made by "
            "'vllm-hs stage') from its commits since the release tag: one patch per "
            "commit, headers kept, the series file rewritten in commit order."
        ),
        epilog=(
            "example:\n  vllm-hs refresh --tree vllm-0.33.0"
            "\n\nThe stage / refresh loop and release bumps, step by step: "
            "patches/README.md (in the repository, and in the installed "
            "package as vllm_hs/patches/README.md)."
        ),
    )
    parser.add_argument(
        "--tree",
        type=Path,
        required=True,
        metavar="DIR",
        help="the staged repository (its checked-out branch is read)",
    )
    parser.add_argument(
        "--version",
        default=None,
        metavar="X",
        help="the vLLM release of the branch (default: recorded by vllm-hs stage)",
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="REF",
        help="the commit the series starts from (default: tag v<X>)",
    )
    parser.add_argument(
        "--revision",
        type=int,
        default=None,
        metavar="N",
        help="set the series revision (the +hs.N of patched wheels); default: keep "
        "it, or 1 for a new series",
    )
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_refresh)


def run_refresh(args: argparse.Namespace) -> int:
    outcome = refresh(
        args.tree,
        series_root=args.series_dir,
        version=args.version,
        base=args.base,
        revision=args.revision,
    )
    for name in outcome.written:
        mark = "changed" if name in outcome.changed else "same"
        print(f"{mark:8} {name}")
    for name in outcome.removed:
        print(f"removed  {name}")
    print(f"wrote {len(outcome.written)} patches and the series to {outcome.directory}")
    return EXIT_OK


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
