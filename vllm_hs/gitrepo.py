"""A thin, typed wrapper over the git command line for the staging repositories."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vllm_hs.series import VllmHsError

# Commits vllm-hs makes itself (the upstream import) carry this identity; patches
# applied with `git am` keep their own author, and get this committer unless the
# user's git configuration names one.
IDENTITY = ("vllm-hs", "vllm-hs@localhost")


class GitError(VllmHsError):
    def __init__(self, command: list[str], returncode: int, output: str) -> None:
        shown = " ".join(command)
        super().__init__(f"git {shown} failed (exit {returncode}):\n{output}")
        self.returncode = returncode
        self.output = output


@dataclass(frozen=True)
class Repo:
    path: Path

    def git(self, *args: str, check: bool = True, input: str | None = None) -> str:
        """Run git in the repository; return stdout (stderr is folded into errors)."""
        env = {**self._identity, **os.environ}
        env["GIT_EDITOR"] = "true"  # `rebase --continue` and friends never prompt
        result = subprocess.run(
            ["git", "-c", "core.autocrlf=false", *args],
            cwd=self.path,
            env=env,
            input=input,
            text=True,
            capture_output=True,
        )
        if check and result.returncode != 0:
            output = (result.stdout + result.stderr).strip()
            raise GitError(list(args), result.returncode, output)
        return result.stdout

    @functools.cached_property
    def _identity(self) -> dict[str, str]:
        """GIT_{AUTHOR,COMMITTER}_{NAME,EMAIL}: the git configuration's user, else
        IDENTITY; looked up once per Repo (the environment still wins)."""
        values = []
        for key, fallback in zip(("user.name", "user.email"), IDENTITY, strict=True):
            result = subprocess.run(
                ["git", "config", "--get", key],
                cwd=self.path if self.path.is_dir() else None,
                text=True,
                capture_output=True,
            )
            values.append(result.stdout.strip() or fallback)
        name, email = values
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

    def is_clean(self) -> bool:
        return not self.git("status", "--porcelain", "--untracked-files=no").strip()

    def config_set(self, key: str, value: str) -> None:
        self.git("config", key, value)

    def config_get(self, key: str) -> str | None:
        return self.git("config", "--get", key, check=False).strip() or None
