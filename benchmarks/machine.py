"""Facts of the machine and of the vLLM installs a run measures."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def machine_facts() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import psutil

        facts["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return facts


def installed_versions(python: str = sys.executable) -> dict[str, Any]:
    """vLLM version and vllm-hs series of the vllm importable by `python`,
    read without importing vllm (vllm-hs status --json)."""
    code = (
        "import json; from vllm_hs.series.status import installed_status, status_dict; "
        "print(json.dumps(status_dict(installed_status())))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        ).stdout
        return json.loads(out)
    except (subprocess.SubprocessError, json.JSONDecodeError, OSError) as e:
        return {"error": str(e)}


def has_channel(python: str) -> bool:
    """Whether the vllm importable by `python` has the hidden-state channel
    (`vllm_hs.patched_vllm`'s check, in that interpreter)."""
    code = (
        "import sys; from vllm_hs.patched_vllm import unpatched_reason; "
        "sys.exit(1 if unpatched_reason() else 0)"
    )
    try:
        subprocess.run(
            [python, "-c", code],
            capture_output=True,
            check=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        return True
    except (subprocess.SubprocessError, OSError):
        return False


def vllm_release(versions: dict[str, Any]) -> str:
    version = str(versions.get("vllm_version") or "unknown")
    return "v" + version.split("+", 1)[0]


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
