"""`vllm-hs lint`: check a series against vLLM's source release, patch by patch.

For each series (default: every `patches/v<X>/`):

* series: every listed patch exists, no `*.patch` file is left unlisted;
* header: a `[Tag] Subject` (vLLM's PR title style), a description, `Upstream-Status:`
  (Pending | Submitted <url> | Accepted <url> | Backport vLLM <X.Y.Z> |
  Not-for-upstream [reason]; Backport: the change is upstream from that release on),
  `vLLM-Version: <X>`, no `Signed-off-by:` (the DCO needs a person: `vllm-hs
  stage` signs each commit off as whoever stages it) and, on a
  fix proposed as its own PR rather than as part of the channel's,
  `Upstream-PR: separate`;
* apply: `git am` onto the sdist of X (no fuzz: git needs exact context), and the
  patch regenerated from the resulting commit has the same hunk positions (no
  offset: the patch was made against X, not against something nearby);
* compile: every Python file the patch adds or changes byte-compiles after it;
* ruff: after the whole series, `ruff check` and `ruff format` with vLLM's own
  configuration (the tree's pyproject.toml) report nothing on the lines the series
  adds. vLLM pins its ruff version in .pre-commit-config.yaml; another ruff version
  is used with a warning;
* mypy: after the whole series, mypy with vLLM's configuration (the tree's
  pyproject.toml, Python 3.11 as vLLM's pre-commit hook runs it) reports nothing
  on the Python files the series adds under vllm/ and tests/ (not on vLLM's own
  files it changes, in which upstream's check already reports errors). Skipped
  with a warning where mypy is not installed (the tox environments pin it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from unidiff import PatchSet

from vllm_hs.command import EXIT_ERROR, EXIT_OK, add_series_dir_option
from vllm_hs.errors import VllmHsError
from vllm_hs.input_checks import existing_file, require
from vllm_hs.proc import run
from vllm_hs.series.git import GitError, Repo
from vllm_hs.series.model import (
    Patch,
    PatchMail,
    available_versions,
    default_series_root,
    load_series,
    unlisted_patches,
)
from vllm_hs.series.tree import FORMAT_PATCH_OPTIONS, import_release

logger = logging.getLogger(__name__)

_STATUS_RE = re.compile(
    r"^(Pending|(Submitted|Accepted) https?://\S+|Backport vLLM \d+\.\d+\.\d+"
    r"|Not-for-upstream(\s.+)?)$"
)
_TAGGED_SUBJECT_RE = re.compile(r"^\[[A-Za-z0-9][\w./ -]*\] \S")
# mypy's "path:line: error: message  [code]" lines.
_MYPY_ERROR_RE = re.compile(
    r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+): error: (?P<message>.*)$"
)
# The Python version vLLM's mypy pre-commit hook checks for (its oldest).
MYPY_PYTHON_VERSION = "3.11"
_PRE_COMMIT_RUFF_RE = re.compile(
    r"ruff-pre-commit\s*\n\s*rev:\s*v?([0-9][^\s]*)", re.MULTILINE
)


@dataclass(frozen=True)
class Finding:
    version: str  # the series' vLLM version
    patch: str | None  # the patch file's name; None for the whole series
    check: str  # series | header | apply | offset | compile | ruff | mypy
    message: str

    def __str__(self) -> str:
        where = self.patch or "series"
        return f"v{self.version} {where}: [{self.check}] {self.message}"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lint",
        help="check the series: headers, clean apply, byte-compile, vLLM's ruff "
        "and mypy",
        description=(
            "Check each series against vLLM's source release (the PyPI sdist): "
            "header fields, git am with no fuzz and no offset, byte-compilation "
            "after every patch, ruff with vLLM's own configuration on the lines "
            "the series adds, and mypy with vLLM's configuration on the Python "
            "files it adds. Exits 1 when anything is found."
        ),
        epilog=(
            "examples:\n  vllm-hs lint\n  vllm-hs lint --version 0.33.0"
            "\n\nThe patch format (headers, Upstream-Status): patches/README.md "
            "(in the repository, and in the installed package as "
            "vllm_hs/patches/README.md)."
        ),
    )
    parser.add_argument(
        "--version",
        action="append",
        default=None,
        metavar="X",
        help="the series to check (repeatable; default: all)",
    )
    parser.add_argument(
        "--sdist",
        type=Path,
        default=None,
        metavar="FILE",
        help="a local vllm-<X>.tar.gz (with a single --version) instead of fetching",
    )
    parser.add_argument("--no-ruff", action="store_true", help="skip the ruff checks")
    parser.add_argument("--no-mypy", action="store_true", help="skip the mypy check")
    add_series_dir_option(parser)
    parser.set_defaults(handler=run_lint)


def run_lint(args: argparse.Namespace) -> int:
    require("--sdist", args.sdist, existing_file)
    series_root = args.series_dir or default_series_root()
    versions = args.version or available_versions(series_root)
    if args.sdist is not None and len(versions) != 1:
        raise VllmHsError("--sdist needs exactly one --version")
    findings: list[Finding] = []
    # One mypy cache for every version: what the trees import from outside
    # (torch, transformers) is checked once, not once per version.
    with tempfile.TemporaryDirectory(prefix="vllm-hs-mypy-") as mypy_cache:
        for version in versions:
            found = lint_series(
                version,
                series_root=series_root,
                sdist=args.sdist,
                ruff=not args.no_ruff,
                mypy=not args.no_mypy,
                mypy_cache=Path(mypy_cache),
            )
            findings += found
            print(f"v{version}: {'ok' if not found else f'{len(found)} problem(s)'}")
    for finding in findings:
        print(finding)
    return EXIT_ERROR if findings else EXIT_OK


def lint_series(
    version: str,
    *,
    series_root: Path | None = None,
    sdist: Path | None = None,
    ruff: bool = True,
    mypy: bool = True,
    mypy_cache: Path | None = None,
) -> list[Finding]:
    """The problems of series `version`. `mypy_cache` (default: a fresh
    directory) may be shared between calls: mypy rechecks a module whose
    source differs from the cached one, and never caches one with errors."""
    series_root = series_root or default_series_root()
    try:
        series = load_series(series_root, version)
    except VllmHsError as error:
        return [Finding(version, None, "series", str(error))]
    findings = [
        Finding(version, name, "series", "not listed in the series file")
        for name in unlisted_patches(series)
    ]
    for patch in series.patches:
        findings += [
            Finding(version, patch.name, "header", message)
            for message in header_problems(patch, version)
        ]
    with tempfile.TemporaryDirectory(prefix="vllm-hs-lint-") as scratch:
        repo = Repo.init(Path(scratch) / f"vllm-{version}")
        base = import_release(repo, version, sdist)
        repo.git("checkout", "-q", "-b", "lint", base)
        for patch in series.patches:
            problems = _apply_and_check(repo, patch)
            findings += [Finding(version, patch.name, c, m) for c, m in problems]
            if any(check == "apply" for check, _ in problems):
                return findings  # later patches build on this one
        if ruff:
            findings += [
                Finding(version, None, "ruff", message)
                for message in ruff_problems(repo, base)
            ]
        # mypy stops at a file that does not compile, wherever it is imported.
        if mypy and not any(finding.check == "compile" for finding in findings):
            findings += [
                Finding(version, None, "mypy", message)
                for message in mypy_problems(repo, base, mypy_cache)
            ]
    return findings


def header_problems(patch: Patch, version: str) -> list[str]:
    mail = patch.mail
    problems = []
    if mail.subject is None:
        problems.append("no 'Subject: [PATCH] ...' line (not git format-patch output)")
    elif not _TAGGED_SUBJECT_RE.match(mail.subject):
        problems.append(
            f"subject {mail.subject!r} lacks vLLM's '[Tag] ' prefix "
            "(e.g. [Core], [Frontend])"
        )
    trailer_lines = {f"{key}: {value}" for key, value in mail.trailers}
    description = [
        line
        for line in mail.message.splitlines()
        if line.strip() and line.strip() not in trailer_lines
    ]
    if not description:
        problems.append("no description (what the patch does and why)")
    status = patch.headers.get("Upstream-Status")
    if status is None:
        problems.append("no 'Upstream-Status:' field")
    elif not _STATUS_RE.match(status):
        problems.append(
            f"Upstream-Status {status!r} is not Pending, Submitted <url>, "
            "Accepted <url>, Backport vLLM <X.Y.Z> or Not-for-upstream"
        )
    target = patch.headers.get("vLLM-Version")
    if target is None:
        problems.append("no 'vLLM-Version:' field")
    elif target != version:
        problems.append(f"vLLM-Version {target} in the series for {version}")
    if "Signed-off-by" in patch.headers:
        problems.append(
            "a 'Signed-off-by:' trailer: the series carries none, vllm-hs stage "
            "signs each commit off as the person staging it (the DCO needs a person)"
        )
    pr = patch.headers.get("Upstream-PR")
    if pr is not None and pr != "separate":
        problems.append(
            f"Upstream-PR {pr!r}: the only value is 'separate' (a fix proposed "
            "as its own PR; without the field a patch is part of the channel's PR)"
        )
    return problems


def _apply_and_check(repo: Repo, patch: Patch) -> list[tuple[str, str]]:
    try:
        repo.am(patch.path)
    except GitError as error:
        return [("apply", f"does not apply: {error.output}")]
    problems = []
    regenerated = repo.git("format-patch", "--stdout", *FORMAT_PATCH_OPTIONS, "-1")
    moved = _hunk_positions(patch.mail.diff) != _hunk_positions(
        PatchMail.parse(regenerated).diff
    )
    if moved:
        problems.append(
            (
                "offset",
                "applies only at other line numbers (offset); regenerate it from "
                "a tree at this release (vllm-hs stage + refresh)",
            )
        )
    changed = repo.git("diff", "--name-only", "--diff-filter=AM", "HEAD~1", "HEAD")
    for path in changed.split():
        if path.endswith(".py"):
            error = _compile_error(repo.path, path)
            if error is not None:
                problems.append(("compile", f"{path}:{error.lineno}: {error.msg}"))
    return problems


def _hunk_positions(diff: str) -> list[tuple[str, str, list[tuple[int, ...]]]]:
    """Per file of the diff: its paths and the position and size of every hunk."""
    return [
        (
            patched.source_file,
            patched.target_file,
            [
                (h.source_start, h.source_length, h.target_start, h.target_length)
                for h in patched
            ],
        )
        for patched in PatchSet(diff)
    ]


def ruff_command() -> list[str]:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    if ruff is None:
        raise VllmHsError("ruff is not installed (pip install ruff)")
    return [ruff]


def ruff_problems(repo: Repo, base: str) -> list[str]:
    """ruff check + format findings on lines the series adds, with vLLM's config."""
    added = added_lines(repo, base)
    # Files that do not compile are reported by the compile check; ruff format
    # refuses them.
    files = sorted(
        path
        for path in added
        if path.endswith(".py") and _compile_error(repo.path, path) is None
    )
    if not files:
        return []
    ruff = ruff_command()
    _warn_on_ruff_version(repo.path, ruff)
    config = ["--config", str(repo.path / "pyproject.toml")]
    check = run(
        [*ruff, "check", "--no-cache", *config, "--output-format", "json", *files],
        cwd=repo.path,
        check=False,
    )
    if check.returncode not in (0, 1):
        raise VllmHsError(f"ruff check failed: {check.stderr.strip()}")
    problems = []
    for item in json.loads(check.stdout or "[]"):
        path = Path(item["filename"]).resolve().relative_to(repo.path.resolve())
        row = item["location"]["row"]
        if row in added.get(path.as_posix(), set()):
            problems.append(f"{path}:{row}: {item['code']} {item['message']}")
    formatted = run(
        [*ruff, "format", "--no-cache", *config, "--diff", *files],
        cwd=repo.path,
        check=False,
    )
    if formatted.returncode not in (0, 1):
        raise VllmHsError(f"ruff format failed: {formatted.stderr.strip()}")
    for path, row in _reformatted_lines(formatted.stdout):
        if row in added.get(path, set()):
            problems.append(f"{path}:{row}: not formatted as ruff format would")
    return problems


def mypy_problems(repo: Repo, base: str, cache: Path | None = None) -> list[str]:
    """mypy errors in the Python files the commits since base add under vllm/
    and tests/, with the tree's configuration (and mypy cache `cache`, default
    a fresh one); [] (and a warning) where mypy is not installed."""
    if importlib.util.find_spec("mypy") is None:
        logger.warning(
            "mypy is not installed: the series' modules are not type-checked"
        )
        return []
    added = repo.git("diff", "--name-only", "--diff-filter=A", base, "HEAD").split()
    files = sorted(
        path
        for path in added
        if path.startswith(("vllm/", "tests/")) and path.endswith(".py")
    )
    if not files:
        return []
    with contextlib.ExitStack() as stack:
        if cache is None:
            cache = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-hs-mypy-"))
            )
        checked = run(
            [
                sys.executable,
                "-m",
                "mypy",
                "--config-file",
                str(repo.path / "pyproject.toml"),
                "--python-version",
                MYPY_PYTHON_VERSION,
                "--cache-dir",
                str(cache),
                "--no-error-summary",
                "--show-error-codes",
                *files,
            ],
            cwd=repo.path,
            check=False,
        )
    if checked.returncode not in (0, 1):
        raise VllmHsError(f"mypy failed: {(checked.stderr or checked.stdout).strip()}")
    matches = [
        match
        for match in map(_MYPY_ERROR_RE.match, checked.stdout.splitlines())
        if match
    ]
    if checked.returncode == 1 and not matches:
        raise VllmHsError(f"mypy failed: {checked.stdout.strip()}")
    # Only the added modules: errors in files they import (vLLM's own, under a
    # configuration that follows imports) are not the series'.
    return [
        f"{match['path']}:{match['line']}: {match['message']}"
        for match in matches
        if match["path"] in files
    ]


def _compile_error(tree: Path, path: str) -> SyntaxError | None:
    """Why tree/path does not byte-compile, or None if it does."""
    try:
        compile((tree / path).read_bytes(), path, "exec", dont_inherit=True)
    except SyntaxError as error:
        return error
    return None


def added_lines(repo: Repo, base: str) -> dict[str, set[int]]:
    """Per file, the line numbers (in HEAD) of lines the commits since base add."""
    diff = repo.git("diff", "-U0", "--no-color", "--no-renames", base, "HEAD")
    result: dict[str, set[int]] = {}
    for patched in PatchSet(diff):
        if patched.is_removed_file:
            continue
        lines = result.setdefault(patched.path, set())
        lines.update(
            line.target_line_no
            for hunk in patched
            for line in hunk
            if line.is_added and line.target_line_no is not None
        )
    return result


def _reformatted_lines(diff: str) -> list[tuple[str, int]]:
    """(path, old line number) of every line a `ruff format --diff` would rewrite."""
    return [
        (patched.source_file.removeprefix("a/"), line.source_line_no)
        for patched in PatchSet(diff)
        for hunk in patched
        for line in hunk
        if line.is_removed and line.source_line_no is not None
    ]


def _warn_on_ruff_version(tree: Path, ruff: list[str]) -> None:
    config = tree / ".pre-commit-config.yaml"
    if not config.is_file():
        return
    match = _PRE_COMMIT_RUFF_RE.search(config.read_text(encoding="utf-8"))
    if match is None:
        return
    version = run([*ruff, "--version"]).stdout.split()[-1]
    if version != match.group(1):
        logger.warning(
            "lint: warning: vLLM pins ruff %s, this is ruff %s", match.group(1), version
        )
