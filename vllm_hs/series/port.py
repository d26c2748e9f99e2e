"""`vllm-hs port`: carry a series from vLLM V to vLLM X, patch by patch.

    vllm-hs port --from V --to X [--dest DIR | --source CHECKOUT]
    vllm-hs port --continue --tree DIR
    vllm-hs port --abort --tree DIR

The repository holds V and X (X's sdist committed on top of V's, or a git checkout
with the tags v<V> and v<X>), V's series applied as the branch `hidden-states-v<V>`,
and the branch `hidden-states-v<X>` on v<X>, onto which each commit of the series is
cherry-picked in order with git's three-way merge. Each patch gets a fate:

- clean: applied, its diff unchanged (`git patch-id --stable`);
- merged: applied by the three-way merge, its diff changed by upstream's changes
  around it;
- resolved: stopped on a conflict and resolved by hand;
- dropped: nothing left to apply (the change is already upstream), or resolved to
  nothing; left out of the new series and listed.

On a conflict the port stops with a report: the patch, its conflicted files, the
patch's hunks in each and what upstream changed in those lines between V and X
(and the commits that did, in a git checkout). Resolve the files, `git add` them,
and `vllm-hs port --continue --tree DIR`; `--abort` puts the repository back. At
the end `vllm-hs refresh` writes `patches/v<X>/` (byte-stable; `vLLM-Version: X`;
revision 1 for a new series) and the summary lists each patch's fate.

This is the one entry point of a release bump (`port`); the repository is made
as `vllm-hs stage` makes its own, by `vllm_hs.series.tree`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_hs.command import EXIT_ERROR, EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.input_checks import can_be_made, existing_dir, existing_file, require
from vllm_hs.series.git import GitError, Repo
from vllm_hs.series.hunks import overlapping, parse_hunks, to_old_line
from vllm_hs.series.model import (
    SERIES_FILE,
    Series,
    default_series_root,
    load_series,
    writable_series_root,
)
from vllm_hs.series.tree import prepare_tree, refresh

STATE_FILE = "vllm-hs-port.json"
FATES = ("clean", "merged", "resolved", "dropped")
# Lines around a patch's hunk in which upstream's changes are reported.
_MARGIN = 3
_UNMERGED = {"DD", "AU", "UD", "UA", "DU", "AA", "UU"}


@dataclass
class PortState:
    """What a port in progress needs to go on; kept in the repository's git dir."""

    from_version: str  # V
    to_version: str  # X
    source_branch: str  # hidden-states-v<V>: V's series as commits
    branch: str  # hidden-states-v<X>: the port
    series_root: str  # where patches/v<X>/ is written at the end
    patches: list[str]  # patch names, in series order
    commits: list[str]  # the source branch's commit of each patch
    fates: dict[str, str] = field(default_factory=dict)
    # The patch stopped on a conflict, and the branch head before it.
    stopped: str | None = None
    head_before: str | None = None

    @property
    def next_index(self) -> int:
        return len(self.fates)

    def save(self, repo: Repo) -> None:
        _state_path(repo).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, repo: Repo) -> PortState:
        path = _state_path(repo)
        if not path.is_file():
            raise VllmHsError(f"{repo.path} has no port in progress (no {path.name})")
        return cls(**json.loads(path.read_text()))


@dataclass(frozen=True)
class PortOutcome:
    repo: Repo
    state: PortState
    # The report of the conflict the port stopped on, else None (finished).
    conflict: str | None = None

    def summary(self) -> str:
        state = self.state
        lines = [f"port of series v{state.from_version} to vLLM {state.to_version}:"]
        for name in state.patches:
            fate = state.fates.get(name, "stopped" if name == state.stopped else "-")
            lines.append(f"  {fate:9} {name}")
        counts = [
            f"{sum(f == fate for f in state.fates.values())} {fate}" for fate in FATES
        ]
        lines.append("  " + ", ".join(counts))
        return "\n".join(lines)


def _state_path(repo: Repo) -> Path:
    return repo.git_dir() / STATE_FILE


def port(
    from_version: str,
    to_version: str,
    *,
    dest: Path | None = None,
    source: Path | None = None,
    sdist: Path | None = None,
    from_sdist: Path | None = None,
    series_root: Path | None = None,
    branch: str | None = None,
) -> PortOutcome:
    """Carry the series of vLLM V (`from_version`) onto X (`to_version`): V's
    series applied as `hidden-states-v<V>` on v<V> in a repository holding both
    releases (see `vllm_hs.series.tree.prepare_tree`), then ported onto v<X> as
    `branch` (default hidden-states-v<X>) until done or a conflict."""
    series = load_series(series_root or default_series_root(), from_version)
    source_branch = f"hidden-states-v{from_version}"
    branch = branch or f"hidden-states-v{to_version}"
    repo = prepare_tree(
        to_version,
        series,
        series_branch=source_branch,
        branch=branch,
        dest=dest,
        source=source,
        sdist=sdist,
        series_sdist=from_sdist,
    )
    return start(
        repo,
        series,
        to_version,
        source_branch=source_branch,
        branch=branch,
        series_root=series_root or writable_series_root(),
    )


def start(
    repo: Repo,
    series: Series,
    to_version: str,
    *,
    source_branch: str,
    branch: str,
    series_root: Path,
) -> PortOutcome:
    """Port the commits source_branch has on v<V> (one per patch of `series`) onto
    v<X> as `branch`, until done or a conflict."""
    from_base = f"v{series.vllm_version}"
    commits = repo.git("rev-list", "--reverse", f"{from_base}..{source_branch}").split()
    if len(commits) != len(series.patches):
        raise VllmHsError(
            f"{source_branch} has {len(commits)} commits on {from_base} for the "
            f"{len(series.patches)} patches of series {series.name}"
        )
    repo.git("checkout", "-q", "-b", branch, f"v{to_version}")
    state = PortState(
        from_version=series.vllm_version,
        to_version=to_version,
        source_branch=source_branch,
        branch=branch,
        series_root=str(series_root),
        patches=[patch.name for patch in series.patches],
        commits=commits,
    )
    state.save(repo)
    return _run(repo, state)


def resume(repo: Repo) -> PortOutcome:
    """Go on after a conflict was resolved (and `git add`ed) in the work tree."""
    state = PortState.load(repo)
    if state.stopped is None:
        raise VllmHsError(f"the port in {repo.path} is not stopped on a conflict")
    if _picking(repo):
        unmerged = _unmerged(repo)
        if unmerged:
            raise VllmHsError(
                "unresolved conflicts remain; resolve them and 'git add' the "
                "files:\n" + "\n".join(unmerged)
            )
        if _index_matches_head(repo):
            # Resolved to nothing: the change is already upstream.
            repo.git("cherry-pick", "--skip")
        else:
            repo.git("cherry-pick", "--continue")
    head = repo.git("rev-parse", "HEAD").strip()
    fate = "dropped" if head == state.head_before else "resolved"
    state.fates[state.stopped] = fate
    state.stopped = state.head_before = None
    state.save(repo)
    return _run(repo, state)


def abort(repo: Repo) -> None:
    """Undo the port: the branch and the state go; the source branch stays."""
    state = PortState.load(repo)
    if _picking(repo):
        repo.git("cherry-pick", "--abort", check=False)
    repo.git("checkout", "-q", "--force", state.source_branch)
    repo.git("branch", "-q", "-D", state.branch, check=False)
    _state_path(repo).unlink()


def _run(repo: Repo, state: PortState) -> PortOutcome:
    while state.next_index < len(state.patches):
        index = state.next_index
        name, commit = state.patches[index], state.commits[index]
        head = repo.git("rev-parse", "HEAD").strip()
        try:
            repo.git("cherry-pick", "--allow-empty-message", commit)
        except GitError as error:
            if not _unmerged(repo) and _index_matches_head(repo):
                repo.git("cherry-pick", "--skip")
                state.fates[name] = "dropped"
                state.save(repo)
                continue
            state.stopped, state.head_before = name, head
            state.save(repo)
            return PortOutcome(repo, state, conflict_report(repo, state, error.output))
        same = _patch_id(repo, commit) == _patch_id(repo, "HEAD")
        state.fates[name] = "clean" if same else "merged"
        state.save(repo)
    return PortOutcome(repo, state)


def finish(outcome: PortOutcome, revision: int | None = None) -> Path:
    """Write patches/v<X>/ from the ported branch (vllm-hs refresh); the port is
    over. The series file's comments come from V's series; where X had a series
    of its own, the new one is its next revision."""
    state = outcome.state
    series_root = Path(state.series_root)
    own = series_root / f"v{state.to_version}" / SERIES_FILE
    if revision is None and own.exists():
        revision = load_series(series_root, state.to_version).revision + 1
    refreshed = refresh(
        outcome.repo.path,
        series_root=series_root,
        version=state.to_version,
        base=f"v{state.to_version}",
        revision=revision,
        origin=state.from_version,
    )
    _state_path(outcome.repo).unlink()
    return refreshed.directory


def _picking(repo: Repo) -> bool:
    return (repo.git_dir() / "CHERRY_PICK_HEAD").exists()


def _unmerged(repo: Repo) -> list[str]:
    status = repo.git("status", "--porcelain", "--untracked-files=no")
    return [line for line in status.splitlines() if line[:2] in _UNMERGED]


def _index_matches_head(repo: Repo) -> bool:
    return not repo.git("diff", "--cached", "--name-only", "HEAD").strip()


def _patch_id(repo: Repo, commit: str) -> str:
    diff = repo.git("show", "--format=", commit)
    out = repo.git("patch-id", "--stable", input=diff).split()
    return out[0] if out else ""


# -- the conflict report ------------------------------------------------------


def conflict_report(repo: Repo, state: PortState, git_output: str) -> str:
    name = state.stopped
    assert name is not None
    commit = state.commits[state.patches.index(name)]
    from_tag, to_tag = f"v{state.from_version}", f"v{state.to_version}"
    unmerged = _unmerged(repo)
    lines = [
        f"{name} ({state.next_index + 1} of {len(state.patches)}) does not apply "
        f"cleanly to vLLM {state.to_version}:",
        # git's own hints name git's commands; the port's follow below.
        *(
            line
            for line in git_output.strip().splitlines()
            if not line.startswith("hint:")
        ),
        "",
        "conflicted files:",
        *(f"  {line}" for line in unmerged),
    ]
    for status in unmerged:
        path = status[3:]
        lines += ["", f"=== {path}: the patch's hunks ({name})"]
        patch_hunks = parse_hunks(repo.git("show", "--format=", commit, "--", path))
        lines.append("".join(hunk.text for hunk in patch_hunks).rstrip())
        # The patch's hunks, in the coordinates of V's file (earlier patches of
        # the series may have moved its lines).
        earlier = parse_hunks(
            repo.git("diff", "-U0", from_tag, f"{commit}^", "--", path, check=False)
        )
        ranges = [
            (
                to_old_line(hunk.old_start, earlier) - _MARGIN,
                to_old_line(hunk.old_start + hunk.old_len, earlier) + _MARGIN,
            )
            for hunk in patch_hunks
        ]
        upstream = parse_hunks(
            repo.git("diff", from_tag, to_tag, "--", path, check=False)
        )
        changed = overlapping(upstream, ranges)
        lines.append(
            f"=== {path}: upstream's changes to those lines, {from_tag} -> {to_tag}"
        )
        if status[:2] in {"DU", "UD", "DD"}:
            lines.append(f"(deleted on one side: git status {status[:2]})")
        lines.append(
            "".join(hunk.text for hunk in changed).rstrip()
            or "(none in these lines: the conflict comes from nearby changes)"
        )
        log = repo.git(
            "log", "--format=%h %s", f"{from_tag}..{to_tag}", "--", path, check=False
        ).strip()
        if log:
            lines += [f"=== {path}: commits {from_tag}..{to_tag}", log]
    lines += [
        "",
        f"Resolve the conflicts in {repo.path}, 'git add' the files, then run",
        f"  vllm-hs port --continue --tree {repo.path}",
        f"or undo the port with: vllm-hs port --abort --tree {repo.path}",
    ]
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "port",
        help="carry a series to a new vLLM release, patch by patch",
        description=(
            "Carry the series of vLLM V onto vLLM X: each patch is cherry-picked "
            "with git's three-way merge; a conflict stops the port with a report "
            "(the patch, its files and hunks, upstream's changes to those lines); "
            "patches already upstream are dropped. At the end patches/v<X>/ is "
            "written and each patch's fate listed (clean, merged, resolved, "
            "dropped)."
        ),
        epilog=(
            "examples:\n"
            "  vllm-hs port --from 0.33.0 --to 0.34.0\n"
            "  vllm-hs port --continue --tree vllm-0.34.0\n"
            "  vllm-hs port --abort --tree vllm-0.34.0"
            "\n\nThe stage / refresh loop and release bumps, step by step: "
            "patches/README.md (in the repository, and in the installed "
            "package as vllm_hs/patches/README.md)."
        ),
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="go on after resolving a conflict (with --tree)",
    )
    action.add_argument(
        "--abort", action="store_true", help="undo the port (with --tree)"
    )
    parser.add_argument("--from", dest="from_version", metavar="V", help="series of V")
    parser.add_argument("--to", dest="to_version", metavar="X", help="vLLM release X")
    parser.add_argument(
        "--tree", type=Path, default=None, metavar="DIR", help="the port's repository"
    )
    parser.add_argument(
        "--dest",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to create the repository from the sdists (default: ./vllm-<X>)",
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=None,
        metavar="CHECKOUT",
        help="a clean git checkout of vLLM with the tags v<V> and v<X>",
    )
    parser.add_argument(
        "--sdist", type=Path, default=None, metavar="FILE", help="local sdist of X"
    )
    parser.add_argument(
        "--from-sdist",
        type=Path,
        default=None,
        metavar="FILE",
        help="local sdist of V",
    )
    parser.add_argument(
        "--revision",
        type=int,
        default=None,
        metavar="N",
        help="revision of the new series (default: 1, or kept if it exists)",
    )
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_port)


def run_port(args: argparse.Namespace) -> int:
    require("--tree", args.tree, existing_dir)
    require("--source", args.source, existing_dir)
    require("--sdist", args.sdist, existing_file)
    require("--from-sdist", args.from_sdist, existing_file)
    require("--dest", args.dest, can_be_made)
    if args.resume or args.abort:
        if args.tree is None:
            raise VllmHsError("--continue and --abort need --tree DIR")
        repo = Repo(args.tree.resolve())
        if args.abort:
            abort(repo)
            print(f"port aborted in {repo.path}")
            return EXIT_OK
        outcome = resume(repo)
    else:
        if args.from_version is None or args.to_version is None:
            raise VllmHsError("a port needs --from V and --to X")
        outcome = port(
            args.from_version,
            args.to_version,
            dest=args.dest,
            source=args.source,
            sdist=args.sdist,
            from_sdist=args.from_sdist,
            series_root=args.series_dir,
        )
    return report(outcome, args.revision)


def report(outcome: PortOutcome, revision: int | None = None) -> int:
    if outcome.conflict is not None:
        print(outcome.conflict)
        print()
        print(outcome.summary())
        return EXIT_ERROR
    directory = finish(outcome, revision)
    print(outcome.summary())
    print(f"wrote {directory}")
    return EXIT_OK
