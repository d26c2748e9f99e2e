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
from pathlib import Path

from vllm_hs.command import EXIT_OK, add_series_dir_option
from vllm_hs.input_checks import existing_dir, require
from vllm_hs.series.tree import FORMAT_PATCH_OPTIONS, RefreshOutcome, refresh

# The write-back itself lives in vllm_hs.series.tree (a port ends with it too).
__all__ = ["FORMAT_PATCH_OPTIONS", "RefreshOutcome", "add_parser", "refresh"]


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
    require("--tree", args.tree, existing_dir)
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
