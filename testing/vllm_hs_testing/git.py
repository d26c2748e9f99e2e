"""git for tests: a fixed identity and dates, no user or system configuration,
so that the repositories tests build are the same on every machine."""

from __future__ import annotations

import os


def git_env() -> dict[str, str]:
    """The environment for a test's git commands."""
    return {
        **os.environ,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "vllm-hs tests",
        "GIT_AUTHOR_EMAIL": "tests@vllm-hs.invalid",
        "GIT_COMMITTER_NAME": "vllm-hs tests",
        "GIT_COMMITTER_EMAIL": "tests@vllm-hs.invalid",
        "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    }
