"""benchmarks/gpu.sh on CPU: its argument handling and the plan it prints
(--dry-run), and the model shape it benchmarks (a config vLLM accepts). The
real run needs a CUDA machine with PyPI access."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu.sh"


def gpu_sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO
    )


def test_dry_run_plan(tmp_path: Path) -> None:
    result = gpu_sh("--dry-run", "--venv", str(tmp_path / "v"), "--rounds", "2")
    assert result.returncode == 0, result.stderr
    commands = [line[2:] for line in result.stdout.splitlines() if line[:2] == "+ "]
    python = str(tmp_path / "v" / "bin" / "python")
    expected_order = [
        "python3 -m venv",
        "pip install -q vllm==0.32.0",
        "vllm-hs wheel --vllm vllm==0.32.0 --out dist --install",
        "vllm-hs status",
        "pytest -q tests/engine/test_gpu.py",
        "-m benchmarks.model_shapes llama-3.1-8b",
        "VLLM_USE_V2_MODEL_RUNNER=1",
    ]
    positions = []
    for needle in expected_order:
        found = [i for i, c in enumerate(commands) if needle in c]
        assert found, f"no step runs {needle!r}:\n{result.stdout}"
        positions.append(found[0])
    assert positions == sorted(positions), result.stdout
    for runner in ("mrv2",):
        (bench,) = [c for c in commands if c.endswith(f"v0.32.0-gpu/{runner}")]
        assert bench.split()[2] == python
        for option in ("--load-format dummy", "--dtype bfloat16", "--compile"):
            assert option in bench, bench
        assert "--rounds 2" in bench


def test_skips_and_bad_arguments(tmp_path: Path) -> None:
    result = gpu_sh("--dry-run", "--skip-install", "--skip-tests")
    assert result.returncode == 0, result.stderr
    assert "pip install" not in result.stdout and "pytest" not in result.stdout
    assert "benchmarks run" in result.stdout
    for args, message in (
        (("--bogus",), "unknown argument: --bogus"),
        (("--rounds", "0"), "not a positive number"),
        (("--venv",), "--venv needs a directory"),
    ):
        result = gpu_sh("--dry-run", *args)
        assert result.returncode != 0 and message in result.stderr, result.stderr


def test_model_shape_is_a_config_vllm_accepts(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    dest = tmp_path / "llama-3.1-8b"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.model_shapes", "llama-3.1-8b", str(dest)],
        check=True,
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    config = json.loads((dest / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (4096, 32)
    code = (
        "import sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "m = EngineArgs(model=sys.argv[1], load_format='dummy',"
        " dtype='bfloat16').create_model_config()\n"
        "print(m.get_hidden_size(), m.hf_text_config.num_hidden_layers,"
        " m.get_vocab_size())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(dest)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-3:] == ["4096", "32", "128256"]
