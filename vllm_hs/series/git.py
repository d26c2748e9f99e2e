"""The one git wrapper of the series commands, built on `vllm_hs.proc.run`.

`Repo` runs git in a repository (the staged vLLM trees); `apply_patch` is the one
`git apply` path (outside any repository: apply's staging copy), `Repo.am` the one
`git am` path, `Repo.worktree` the one temporary worktree (always removed), and
`parse_trailers` / `add_trailers` the one reader and writer of commit trailers
(`git interpret-trailers`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_hs.errors import VllmHsError
from vllm_hs.proc import run

# Commits vllm-hs makes itself (the upstream import) carry this identity; patches
# applied with `git am` keep their own author, and get this committer unless the
# user's git configuration names one.
IDENTITY = ("vllm-hs", "vllm-hs@localhost")

# Variables that point git at a repository: removed where git must not use the
# caller's (apply's staging copy is no repository).
_GIT_REPO_VARIABLES = frozenset(
    {"GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_PREFIX"}
)


class GitError(VllmHsError):
    """git exited non-zero; `output` holds what it printed (stdout+stderr)."""

    def __init__(self, command: Sequence[str], returncode: int, output: str) -> None:
        shown = " ".join(command)
        super().__init__(f"git {shown} failed (exit {returncode}):\n{output}")
        self.returncode = returncode
        self.output = output


def git(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    input: str | None = None,
    check: bool = True,
) -> str:
    """Run `git -c core.autocrlf=false ARGS`; return stdout (stderr is folded into
    GitError)."""
    result = run(
        ["git", "-c", "core.autocrlf=false", *args],
        what=f"git {args[0]}" if args else "git",
        cwd=cwd,
        env=env,
        input=input,
        check=False,
    )
    if check and result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise GitError(args, result.returncode, output)
    return result.stdout


def apply_patch(
    patch: Path, directory: Path, *, reverse: bool = False, include: str | None = None
) -> None:
    """`git apply` the patch file to the plain directory (no repository), exactly
    (no fuzz); raises GitError with git's report when it does not apply."""
    command = ["apply", "--whitespace=nowarn"]
    if reverse:
        command.append("--reverse")
    if include is not None:
        command.append(f"--include={include}")
    command.append(str(patch.resolve()))  # git runs in the directory, not here
    # Keep git from finding a repository above the directory, or from using one
    # named by the caller's environment.
    env = {k: v for k, v in os.environ.items() if k not in _GIT_REPO_VARIABLES}
    env["GIT_CEILING_DIRECTORIES"] = str(directory.parent)
    git(*command, cwd=directory, env=env)


def parse_trailers(message: str) -> list[tuple[str, str]]:
    """The trailers of a commit message (its last paragraph, if git reads it as a
    trailer block), as (key, value) pairs in order: `git interpret-trailers
    --parse`. The message must end before a patch mail's `---` line."""
    out = git("interpret-trailers", "--parse", "--no-divider", input=message)
    pairs = []
    for line in out.splitlines():
        key, separator, value = line.partition(":")
        if separator:
            pairs.append((key.strip(), value.strip()))
    return pairs


def add_trailers(message: str, trailers: Sequence[tuple[str, str]]) -> str:
    """The message with the trailers appended to its trailer block (a new block
    after a blank line if it has none): `git interpret-trailers --trailer`."""
    options = [f"--trailer={key}: {value}" for key, value in trailers]
    return git(
        "interpret-trailers",
        "--no-divider",
        "--where=end",
        "--if-exists=add",
        "--if-missing=add",
        *options,
        input=message,
    )


@dataclass(frozen=True)
class Repo:
    """A git repository (work tree at `path`)."""

    path: Path

    def git(self, *args: str, check: bool = True, input: str | None = None) -> str:
        """Run git in the repository; return stdout (stderr is folded into errors)."""
        env = {**self._identity, **os.environ}
        env["GIT_EDITOR"] = "true"  # `rebase --continue` and friends never prompt
        return git(*args, cwd=self.path, env=env, input=input, check=check)

    @functools.cached_property
    def _identity(self) -> dict[str, str]:
        """GIT_{AUTHOR,COMMITTER}_{NAME,EMAIL}: the git configuration's user, else
        IDENTITY; looked up once per Repo (the environment still wins)."""
        cwd = self.path if self.path.is_dir() else None
        name, email = (
            git("config", "--get", key, cwd=cwd, check=False).strip() or fallback
            for key, fallback in zip(("user.name", "user.email"), IDENTITY, strict=True)
        )
        return {
            f"GIT_{role}_{field}": value
            for role in ("AUTHOR", "COMMITTER")
            for field, value in (("NAME", name), ("EMAIL", email))
        }

    @classmethod
    def init(cls, path: Path) -> Repo:
        path.mkdir(parents=True, exist_ok=True)
        repo = cls(path)
        repo.git("init", "-q")
        return repo

    def is_repo(self) -> bool:
        return (
            self.path.is_dir()
            and self.git("rev-parse", "--is-inside-work-tree", check=False).strip()
            == "true"
        )

    def rev(self, ref: str) -> str | None:
        out = self.git("rev-parse", "--verify", "-q", f"{ref}^{{commit}}", check=False)
        return out.strip() or None

    def commit_all(self, message: str) -> str:
        """Commit the whole work tree as it is, ignored files included."""
        self.git("add", "-A", "-f")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD").strip()

    def am(self, patch: Path) -> None:
        """`git am` one patch mail onto the checked-out branch, signed off by the
        committer (the person staging: the DCO needs a person, so the series
        itself carries no sign-off); on failure the am is aborted (the branch
        stays where it was) and GitError raised."""
        try:
            # --keep-non-patch: a "[Core] ..." subject keeps its vLLM-style tag.
            self.git("am", "-q", "--keep-non-patch", "--signoff", str(patch.resolve()))
        except GitError:
            self.git("am", "--abort", check=False)
            raise

    @contextlib.contextmanager
    def worktree(self, path: Path, ref: str, *, keep: bool = False) -> Iterator[Path]:
        """A detached worktree of `ref` at `path`; removed on exit (also on error)
        unless `keep`."""
        self.git("worktree", "add", "-q", "--detach", str(path), ref)
        try:
            yield path
        finally:
            if not keep:
                self.git("worktree", "remove", "--force", str(path), check=False)
                self.git("worktree", "prune", check=False)

    def is_clean(self) -> bool:
        return not self.git("status", "--porcelain", "--untracked-files=no").strip()

    def git_dir(self) -> Path:
        return Path(self.git("rev-parse", "--absolute-git-dir").strip())

    def in_progress(self) -> bool:
        """Whether a rebase, an am or a cherry-pick stopped half way."""
        git_dir = self.git_dir()
        return any(
            (git_dir / name).exists()
            for name in ("rebase-merge", "rebase-apply", "CHERRY_PICK_HEAD")
        )

    def config_set(self, key: str, value: str) -> None:
        self.git("config", key, value)

    def config_get(self, key: str) -> str | None:
        return self.git("config", "--get", key, check=False).strip() or None
