"""Apply (or remove) the patch series to a tree that contains `vllm/`, all or nothing.

Every patch is applied with `git apply` to a staging copy of only the files the
series touches; the tree itself is written only after the whole series succeeded,
and restored from a backup if writing fails half way. A marker
`vllm/_vllm_hs.json` records which series was applied and the sha256 of every
patched file (see `vllm-hs status`).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_hs import __version__
from vllm_hs.command import EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.fs import atomic_copy
from vllm_hs.series.git import GitError, apply_patch
from vllm_hs.series.model import (
    MARKER_FILE,
    Marker,
    Patch,
    PatchDigest,
    Series,
    default_series_root,
    load_series,
    read_marker,
    read_tree_version,
    sha256_file,
    unlisted_patches,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApplyOutcome:
    series: Series
    tree: Path
    reverse: bool
    check: bool
    # Paths (relative to the tree) that the series changes, creates or deletes:
    # a subset of series.touched_paths, in its order.
    changed_paths: tuple[str, ...]
    # The marker written (None for --check and --reverse).
    marker: Marker | None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "apply",
        help="apply the patch series to a tree that contains vllm/",
        description=(
            "Apply the vllm-hs patch series for the tree's vLLM version (read from "
            "vllm/_version.py) to TREE, all or nothing: if any patch fails, TREE is "
            "left exactly as it was. On success the marker vllm/_vllm_hs.json "
            "records the series and the sha256 of every patched file."
        ),
        epilog=(
            "examples:\n"
            "  vllm-hs apply ~/src/vllm --check\n"
            "  vllm-hs apply $(python -c 'import sysconfig; "
            'print(sysconfig.get_paths()["purelib"])\')\n'
            "  vllm-hs apply ~/src/vllm --reverse"
        ),
    )
    parser.add_argument(
        "tree",
        type=Path,
        metavar="TREE",
        help="directory that contains the vllm/ package: site-packages, an unpacked "
        "wheel, or the root of a vLLM source checkout",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="only report whether the whole series applies (or, with --reverse, "
        "can be removed); change nothing",
    )
    parser.add_argument(
        "--reverse",
        action="store_true",
        help="remove a previously applied series and its marker, all or nothing",
    )
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_apply)


def run_apply(args: argparse.Namespace) -> int:
    outcome = apply_series(
        args.tree, args.series_dir, check=args.check, reverse=args.reverse
    )
    print(describe(outcome))
    return EXIT_OK


def describe(outcome: ApplyOutcome) -> str:
    series = outcome.series
    what = f"series {series.name} revision {series.revision}"
    size = f"{len(series.patches)} patches, {len(outcome.changed_paths)} files"
    if outcome.check:
        verb = "can be removed from" if outcome.reverse else "applies cleanly to"
        return f"{what} {verb} {outcome.tree} ({size}); nothing changed"
    verb = "removed from" if outcome.reverse else "applied to"
    return f"{what} {verb} {outcome.tree} ({size})"


def apply_series(
    tree: Path,
    series_root: Path | None = None,
    *,
    check: bool = False,
    reverse: bool = False,
) -> ApplyOutcome:
    """Apply (or with reverse=True remove) the series matching the tree's version."""
    tree = tree.resolve()
    if not (tree / "vllm").is_dir():
        raise VllmHsError(f"{tree} does not contain a vllm/ package directory")
    series = load_series(series_root or default_series_root(), read_tree_version(tree))
    for name in unlisted_patches(series):
        logger.warning("warning: %s is not in the series file", series.directory / name)
    marker = read_marker(tree)
    _check_marker_allows(series, marker, tree, reverse=reverse)

    patches = list(reversed(series.patches)) if reverse else list(series.patches)
    # Patches may add vLLM unit tests (tests/...): they go into a source tree
    # only, never into site-packages or a wheel.
    source_tree = is_source_tree(tree)
    touched = [p for p in series.touched_paths if source_tree or _installable(p)]
    with tempfile.TemporaryDirectory(prefix="vllm-hs-apply-") as scratch:
        stage = Path(scratch) / "stage"
        _copy_existing(tree, stage, touched)
        for patch in patches:
            _git_apply(patch, stage, reverse=reverse, package_only=not source_tree)
        changed = tuple(
            path
            for path in touched
            if _file_bytes(tree / path) != _file_bytes(stage / path)
        )
        if check:
            return ApplyOutcome(series, tree, reverse, check, changed, None)

        new_marker = None if reverse else _marker_for(series, stage, touched)
        _write_back(
            tree,
            stage,
            backup=Path(scratch) / "backup",
            paths=[*touched, MARKER_FILE],
            marker=new_marker,
        )
    return ApplyOutcome(series, tree, reverse, check, changed, new_marker)


def _check_marker_allows(
    series: Series, marker: Marker | None, tree: Path, *, reverse: bool
) -> None:
    if marker is None:
        return
    applied = f"series {marker.series} revision {marker.revision}"
    if not reverse:
        raise VllmHsError(
            f"{tree} is already patched ({applied}, see {MARKER_FILE}); "
            "remove it first with 'vllm-hs apply --reverse'"
        )
    current = tuple(PatchDigest(patch.name, patch.sha256) for patch in series.patches)
    if marker.patches != current:
        raise VllmHsError(
            f"{tree} was patched with {applied} whose patch files differ from those "
            f"in {series.directory}; reverse it with --series-dir pointing at the "
            "series that was applied"
        )


def _copy_existing(tree: Path, stage: Path, paths: list[str]) -> None:
    stage.mkdir(parents=True)
    for path in paths:
        source = tree / path
        if source.is_file():
            (stage / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, stage / path)


def is_source_tree(tree: Path) -> bool:
    """A vLLM source checkout or sdist (has its tests), not an install."""
    return (tree / "pyproject.toml").is_file() and (tree / "tests").is_dir()


def _installable(path: str) -> bool:
    return path.startswith("vllm/")


def _git_apply(
    patch: Patch, stage: Path, *, reverse: bool, package_only: bool = False
) -> None:
    try:
        apply_patch(
            patch.path,
            stage,
            reverse=reverse,
            include="vllm/*" if package_only else None,
        )
    except GitError as error:
        direction = (
            "cannot be removed (reverse apply failed)" if reverse else "does not apply"
        )
        raise VllmHsError(
            f"{patch.name} {direction}; nothing was changed.\n"
            f"git apply said:\n{error.output}"
        ) from None


def _file_bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _marker_for(series: Series, stage: Path, touched: list[str]) -> Marker:
    return Marker(
        series=series.name,
        revision=series.revision,
        vllm_hs_version=__version__,
        patches=tuple(PatchDigest(p.name, p.sha256) for p in series.patches),
        files={
            path: sha256_file(stage / path)
            for path in touched
            if (stage / path).is_file()
        },
    )


def _write_back(
    tree: Path,
    stage: Path,
    *,
    backup: Path,
    paths: list[str],
    marker: Marker | None,
) -> None:
    """Make tree/path equal stage/path for every path (absent means deleted)."""
    if marker is not None:
        (stage / MARKER_FILE).parent.mkdir(parents=True, exist_ok=True)
        (stage / MARKER_FILE).write_text(marker.dumps(), encoding="utf-8")
    else:
        (stage / MARKER_FILE).unlink(missing_ok=True)

    _copy_existing(tree, backup, paths)
    created_dirs: list[Path] = []
    try:
        for path in paths:
            _sync_file(stage / path, tree / path, created_dirs)
    except BaseException:
        for path in paths:
            _sync_file(backup / path, tree / path, [])
        for directory in reversed(created_dirs):
            _remove_if_empty(directory)
        raise
    for path in paths:
        if not (stage / path).exists():
            _remove_empty_parents(tree / path, stop=tree / "vllm")


def _sync_file(source: Path, target: Path, created_dirs: list[Path]) -> None:
    if source.is_file():
        missing = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
        target.parent.mkdir(parents=True, exist_ok=True)
        created_dirs.extend(reversed(missing))
        atomic_copy(source, target)
    elif target.is_file() or target.is_symlink():
        target.unlink()
        _remove_stale_bytecode(target)


def _remove_stale_bytecode(source: Path) -> None:
    cache = source.parent / "__pycache__"
    for compiled in cache.glob(f"{source.stem}.*.pyc"):
        compiled.unlink()
    _remove_if_empty(cache)


def _remove_empty_parents(path: Path, *, stop: Path) -> None:
    for directory in path.parents:
        if directory == stop or stop not in directory.parents:
            return
        if not _remove_if_empty(directory):
            return


def _remove_if_empty(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:
        return False
    return True
