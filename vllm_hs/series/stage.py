"""`vllm-hs stage`: a vLLM source release as a git repository, the series as commits.

The result is a branch `hidden-states-v<X>` on top of the tag `v<X>`, one commit per
patch (`git am`, so each commit message is the patch header), ready to push as a
pull request. The source is the PyPI sdist of vLLM X (imported as one commit, tagged
`v<X>`) or a local git checkout of vLLM that has the tag `v<X>`.

A release bump (the series of vLLM V carried onto X) is `vllm-hs port`
(`vllm_hs.series.port`); both make their repository with `vllm_hs.series.tree`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vllm_hs.command import EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.input_checks import can_be_made, existing_dir, existing_file, require
from vllm_hs.series.git import Repo
from vllm_hs.series.model import Series, default_series_root, load_series
from vllm_hs.series.tree import prepare_tree


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
    series: Series  # X's series, applied

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
            "then, after editing commits on the branch:\n"
            "  vllm-hs refresh --tree vllm-0.32.0\n"
            "a release bump (the series of 0.33.0 carried onto 0.34.0):\n"
            "  vllm-hs port --from 0.33.0 --to 0.34.0"
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
        "--branch",
        default=None,
        metavar="NAME",
        help="branch name (default: hidden-states-v<X>)",
    )
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_stage)


def run_stage(args: argparse.Namespace) -> int:
    require("--source", args.source, existing_dir)
    require("--sdist", args.sdist, existing_file)
    require("--dest", args.dest, can_be_made)
    staged = stage(
        args.version,
        dest=args.dest,
        source=args.source,
        sdist=args.sdist,
        series_root=args.series_dir,
        branch=args.branch,
    )
    where = staged.repo.path
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
    branch: str | None = None,
) -> StagedTree:
    """Stage `version` with its own series as branch `branch` (default
    hidden-states-v<X>) on the tag v<X>."""
    series = load_series(series_root or default_series_root(), version)
    branch = branch or f"hidden-states-v{version}"
    repo = prepare_tree(
        version,
        series,
        series_branch=branch,
        branch=branch,
        dest=dest,
        source=source,
        sdist=sdist,
    )
    return StagedTree(repo, version, f"v{version}", branch, series)


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
