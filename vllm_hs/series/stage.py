"""`vllm-hs stage`: a vLLM source release as a git repository, the series as commits.

The result is a branch `hidden-states-v<X>` on top of the tag `v<X>`, one commit per
patch (`git am`, so each commit message is the patch header), ready to push as a
pull request. The source is the PyPI sdist of vLLM X (imported as one commit, tagged
`v<X>`) or a local git checkout of vLLM that has the tag `v<X>`.

With `--from V` the series of vLLM V is carried onto X instead (a release bump):
this is `vllm-hs port --from V --to X` (see `vllm_hs.series.port`), patch by patch
with git's three-way merge, stopping on a conflict with a report.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_hs.command import EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.series.git import GitError, Repo
from vllm_hs.series.model import (
    Series,
    default_series_root,
    load_series,
    sha256_file,
    writable_series_root,
)
from vllm_hs.series.sdist import fetch_sdist, unpack_sdist

if TYPE_CHECKING:
    from vllm_hs.series.port import PortOutcome

CONFIG_VERSION = "vllm-hs.version"
CONFIG_BASE = "vllm-hs.base"
CONFIG_BRANCH = "vllm-hs.branch"
# The release whose series the branch was made from (differs from X in a bump).
CONFIG_FROM = "vllm-hs.from"


@dataclass(frozen=True)
class FileChange:
    path: str
    added: int  # lines (0 for a binary file)
    removed: int
    new: bool  # the file does not exist upstream


@dataclass(frozen=True)
class Footprint:
    """How much of a change lands in upstream's existing files versus new files."""

    changes: tuple[FileChange, ...]

    @property
    def existing(self) -> list[FileChange]:
        return [change for change in self.changes if not change.new]

    @property
    def new(self) -> list[FileChange]:
        return [change for change in self.changes if change.new]

    def describe(self) -> str:
        existing, new = self.existing, self.new
        added = sum(change.added for change in existing)
        removed = sum(change.removed for change in existing)
        new_lines = sum(change.added for change in new)
        return (
            f"footprint: {len(existing)} existing upstream files changed "
            f"(+{added} -{removed} lines); {len(new)} new files (+{new_lines} lines)"
        )


@dataclass(frozen=True)
class ReviewSize:
    """One patch as a reviewer reads it: the lines it adds or removes in `vllm/`
    (tests and other top-level folders excluded)."""

    patch: str
    lines: int
    # The channel's own change: Upstream-Status Pending and not a separate fix
    # (Upstream-PR: separate), i.e. neither a fix vLLM needs anyway nor
    # Not-for-upstream.
    channel: bool


def review_sizes(repo: Repo, base: str, head: str, series: Series) -> list[ReviewSize]:
    """Per patch of `series`, applied as the commits base..head, one each."""
    commits = repo.git("rev-list", "--reverse", f"{base}..{head}").split()
    if len(commits) != len(series.patches):
        raise VllmHsError(
            f"{base}..{head} has {len(commits)} commits for the "
            f"{len(series.patches)} patches of series {series.name}"
        )
    sizes = []
    for commit, patch in zip(commits, series.patches, strict=True):
        numstat = repo.git("show", "--numstat", "--format=", commit, "--", "vllm/")
        lines = sum(
            int(added) + int(removed)
            for added, removed, _ in (
                line.split("\t", 2) for line in numstat.splitlines() if line
            )
            if added != "-"
        )
        channel = (
            patch.headers.get("Upstream-Status") == "Pending"
            and patch.headers.get("Upstream-PR") != "separate"
        )
        sizes.append(ReviewSize(patch.name, lines, channel))
    return sizes


def describe_review_sizes(sizes: list[ReviewSize]) -> str:
    rows = [
        f"  {size.lines:6d}  {'channel' if size.channel else '       '}  {size.patch}"
        for size in sizes
    ]
    channel = sum(size.lines for size in sizes if size.channel)
    return "\n".join(
        [
            "review size (lines added or removed in vllm/ per patch, tests excluded):",
            *rows,
            f"the channel's own patches: {channel} lines",
        ]
    )


@dataclass(frozen=True)
class StagedTree:
    repo: Repo
    version: str  # X, the release staged on
    base: str  # the tag v<X>
    branch: str  # hidden-states-v<X>: one commit per patch on base
    series: Series  # the series applied (V's for a bump --from V)
    # A bump: the port of V's series onto X (finished, or stopped on a conflict).
    port: PortOutcome | None = None

    @property
    def conflict(self) -> str | None:
        """The report of the conflict a bump stopped on, else None."""
        return self.port.conflict if self.port is not None else None

    def footprint(self) -> Footprint:
        return footprint(self.repo, self.base, self.branch)

    def review_sizes(self) -> list[ReviewSize]:
        return review_sizes(self.repo, self.base, self.branch, self.series)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stage",
        help="stage the series on vLLM's source release as a git branch (for a PR)",
        description=(
            "Make vLLM's source release X a git repository at that release (tag "
            "v<X>) and apply the series as one commit per patch on a new branch "
            "hidden-states-v<X>, ready to push as a pull request. Prints the "
            "diffstat, the footprint (lines changed in existing upstream files "
            "against lines in new files) and each patch's review size (lines it "
            "changes in vllm/, tests excluded; the channel's own patches summed)."
        ),
        epilog=(
            "examples:\n"
            "  vllm-hs stage --version 0.32.0                  # sdist from PyPI\n"
            "  vllm-hs stage --version 0.33.0 --source ~/src/vllm\n"
            "  vllm-hs stage --version 0.34.0 --from 0.33.0    # = vllm-hs port\n"
            "then, after editing commits on the branch:\n"
            "  vllm-hs refresh --tree vllm-0.32.0"
            "\n\nThe stage / refresh loop and release bumps, step by step: "
            "patches/README.md (in the repository, and in the installed "
            "package as vllm_hs/patches/README.md)."
        ),
    )
    parser.add_argument(
        "--version",
        required=True,
        metavar="X",
        help="the vLLM release to stage on, e.g. 0.33.0",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--source",
        type=Path,
        metavar="PATH",
        help="a local git checkout of vLLM that has the tag v<X>; the branch is "
        "made there (its work tree must be clean). Default: the PyPI sdist",
    )
    source.add_argument(
        "--sdist",
        type=Path,
        metavar="FILE",
        help="a local vllm-<X>.tar.gz instead of downloading it",
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to create the repository from the sdist (default: ./vllm-<X>); "
        "must not exist",
    )
    parser.add_argument(
        "--from",
        dest="series_version",
        default=None,
        metavar="V",
        help="carry the series of vLLM V onto X (a release bump: vllm-hs port) "
        "instead of X's own",
    )
    parser.add_argument(
        "--branch",
        default=None,
        metavar="NAME",
        help="branch name (default: hidden-states-v<X>)",
    )
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_stage)


def run_stage(args: argparse.Namespace) -> int:
    staged = stage(
        args.version,
        dest=args.dest,
        source=args.source,
        sdist=args.sdist,
        series_root=args.series_dir,
        series_version=args.series_version,
        branch=args.branch,
    )
    where = staged.repo.path
    if staged.port is not None:
        from vllm_hs.series.port import report

        return report(staged.port)
    print(staged.repo.git("diff", "--stat=100", staged.base, staged.branch).rstrip())
    print(staged.footprint().describe())
    print(describe_review_sizes(staged.review_sizes()))
    print(
        f"branch {staged.branch} in {where}: {len(staged.series.patches)} commits "
        f"on {staged.base} (series {staged.series.name} revision "
        f"{staged.series.revision})"
    )
    return EXIT_OK


def stage(
    version: str,
    *,
    dest: Path | None = None,
    source: Path | None = None,
    sdist: Path | None = None,
    series_root: Path | None = None,
    series_version: str | None = None,
    branch: str | None = None,
    from_sdist: Path | None = None,
) -> StagedTree:
    """Stage `version` with its series; with `series_version` V != X, port V's
    series onto X (`vllm_hs.series.port`): the returned tree's `port` says how far
    it got."""
    series_version = series_version or version
    series = load_series(series_root or default_series_root(), series_version)
    branch = branch or f"hidden-states-v{version}"
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
        if series_version != version:
            import_release(repo, series_version, from_sdist)
        parent = series_base if series_base != base else None
        import_release(repo, version, sdist, parent=parent)

    bump = series_base != base
    # A bump applies V's series on v<V> first, then ports it to `branch`.
    series_branch = f"hidden-states-v{series_version}" if bump else branch
    for name in {branch, series_branch}:
        if repo.rev(f"refs/heads/{name}") is not None:
            raise VllmHsError(f"{repo.path} already has a branch {name}; pass --branch")
    repo.git("checkout", "-q", "-b", series_branch, series_base)
    apply_commits(repo, series)
    repo.config_set(CONFIG_VERSION, version)
    repo.config_set(CONFIG_BASE, base)
    repo.config_set(CONFIG_BRANCH, branch)
    repo.config_set(CONFIG_FROM, series_version)
    staged = StagedTree(repo, version, base, branch, series)
    if not bump:
        return staged
    from vllm_hs.series.port import start

    outcome = start(
        repo,
        series,
        version,
        source_branch=series_branch,
        branch=branch,
        series_root=series_root or writable_series_root(),
    )
    return dataclasses.replace(staged, port=outcome)


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


def footprint(repo: Repo, base: str, head: str) -> Footprint:
    added_paths = set(
        repo.git("diff", "--name-only", "--diff-filter=A", base, head).split()
    )
    changes = []
    for line in repo.git("diff", "--numstat", base, head).splitlines():
        added, removed, path = line.split("\t", 2)
        changes.append(
            FileChange(
                path,
                int(added) if added != "-" else 0,
                int(removed) if removed != "-" else 0,
                path in added_paths,
            )
        )
    return Footprint(tuple(changes))
