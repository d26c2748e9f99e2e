"""`vllm-hs extract` as users run it: a subprocess with vLLM's default
multiprocess engine. Killed mid-way with SIGKILL and resumed, it writes what a
clean run writes (data byte for byte, hidden states to the last bits: see
`assert_same_extraction`); bad input fails with a clear message and writes
nothing."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_hs.cli import main
from vllm_hs.extract.cli import DEFAULT_OUTPUT
from vllm_hs.extract.inputs import load_conversations, shipped_conversations_path
from vllm_hs.extract.manifest import FINGERPRINT_KEYS
from vllm_hs.extract.records import HS_DIR, MANIFEST, SKIPPED


def vllm_hs(
    *args: str, cwd: Path, timeout: float = 600, umask: int = -1
) -> subprocess.CompletedProcess:
    """`vllm-hs extract ARGS` (``umask``: the child's, -1 = inherited)."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_hs", "extract", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        umask=umask,
    )


def digests(output: Path) -> dict[str, str]:
    files = [
        *sorted((output / HS_DIR).iterdir()),
        *sorted(output.glob("data-*.arrow")),
        output / "token_freq.pt",
    ]
    return {
        p.relative_to(output).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files
    }


# A resumed (or redone) run computes a sample in another step than the clean
# run, beside other requests: vLLM's CPU attention splits its work by the whole
# step (scheduler metadata), so a row may differ in the last bits. On Model
# Runner V2, which orders a step's requests as the scheduler does (V1 keeps its
# persistent batch's order), a prompt whose prefix is a cache hit can land in
# such a step: its last row then differs by ~5e-5. A row of another position,
# layer or request differs by orders of magnitude more.
STATES_ATOL = 1e-4


def assert_same_extraction(out: Path, clean: Path) -> None:
    """`out` holds the samples of `clean`: the same files, the Arrow data and
    token counts byte for byte, and in each sample file the same tensors (token
    ids exactly, hidden states within `STATES_ATOL`)."""
    from safetensors.torch import load_file

    ours, theirs = digests(out), digests(clean)
    assert sorted(ours) == sorted(theirs)
    differing = [name for name in theirs if ours[name] != theirs[name]]
    assert not [n for n in differing if not n.startswith(f"{HS_DIR}/")], differing
    for name in differing:
        # Same keys, dtypes and shapes; an absolute tolerance under 1 leaves
        # integer tensors (token ids) to compare exactly.
        torch.testing.assert_close(
            load_file(out / name),
            load_file(clean / name),
            rtol=0,
            atol=STATES_ATOL,
            msg=lambda message, name=name: f"{name}: {message}",
        )


def test_help_names_the_defaults(tmp_path: Path):
    proc = vllm_hs("--help", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for needle in (
        f"./{DEFAULT_OUTPUT}",
        "--resume",
        "--regenerate",
        "--num-shards",
        "--merge",
        "-- ENGINE_ARGS",
        "hidden_states/hs_{i}.safetensors",
        "n % S == I",
        "never truncated",
        "--format",
        "--ray",
        "--replicas",
        "docs/extract.md",  # the guide: files, layer ids, sharding, Ray
    ):
        assert needle in text, needle


def test_malformed_jsonl_fails_before_anything_is_written(tmp_path: Path):
    data = tmp_path / "bad.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{not json\n"
    )
    proc = vllm_hs("--data", str(data), "--output", "out", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "vllm-hs extract: error: --data:" in proc.stderr
    assert "bad.jsonl:2: invalid JSON" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "1,99"], "--layers: layer 99 does not exist: the model has 4"),
        (["--", "--no-such-engine-option"], "invalid vLLM engine options after --"),
        (["--", "--model", "x"], "pass --model to vllm-hs extract, not after --"),
        (["--", "--seed", "1"], "pass --seed to vllm-hs extract, not after --"),
        (["--hidden-states-config", "{}"], "pass --layers to vllm-hs extract"),
        (["--merge", "--dtype", "float32"], "--merge starts no engine"),
        (["--merge", "--ray"], "--merge starts no engine"),
        (
            ["--format", "specforge", "--layers", "1,2,3,4"],
            "--format specforge: the last of --layers must be final_norm",
        ),
        (
            ["--format", "modelopt", "--compress"],
            "--compress is for --format specforge",
        ),
        (["--replicas", "2"], "--replicas and --ray-batch-size need --ray"),
        (["--ray", "--replicas", "0"], "--replicas must be at least 1"),
        (["--ray", "--ray-batch-size", "0"], "--ray-batch-size must be at least 1"),
    ],
)
def test_bad_options_fail_before_the_engine_starts(
    tmp_path: Path, monkeypatch, capsys, args: list[str], message: str
):
    """In this process, through the function the console script calls (a
    subprocess would spend ~10 s a case importing vLLM); the exit status of a
    real process is the malformed-JSONL test's."""
    monkeypatch.chdir(tmp_path)
    assert main(["extract", "--output", "out", *args]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_killed_run_resumes_to_the_samples_of_a_clean_run(
    tmp_path: Path, llm, run_extract
):
    """Run `vllm-hs extract` without arguments (tiny model, shipped data,
    ./vllm-hs-extract-out), SIGKILL its process group (CLI and engine core) once
    40 samples are on disk, resume it, and compare with a clean run."""
    out = tmp_path / DEFAULT_OUTPUT
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_hs", "extract"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            hs_dir = out / HS_DIR
            written = (
                len(list(hs_dir.glob("hs_*.safetensors"))) if hs_dir.is_dir() else 0
            )
            if written >= 40:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert not json.loads((out / MANIFEST).read_text())["complete"]
    before = len(list((out / HS_DIR).glob("hs_*.safetensors")))
    assert 40 <= before < 300

    resumed = vllm_hs("--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"vllm-hs: resuming: {before} of 300 samples" in resumed.stderr
    assert f"wrote {300 - before} samples" in resumed.stdout
    assert "dataset: 300 samples" in resumed.stdout
    assert f"output: {out.resolve()}" in resumed.stdout
    assert not [p for p in out.rglob(".*")], "temp files left behind"

    # The clean run: the same extraction in one go (in-process engine, same
    # layers, dtype and eager mode as the CLI's embedded defaults).
    conversations, sha = load_conversations(shipped_conversations_path())
    clean = tmp_path / "clean"
    run_extract(llm, conversations, clean, data_sha256=sha)
    assert_same_extraction(out, clean)
    assert len(digests(clean)) == 302
    ours, theirs = (json.loads((d / MANIFEST).read_text()) for d in (out, clean))
    for key in (*FINGERPRINT_KEYS, "samples", "tokens", "bytes", "columns"):
        assert ours[key] == theirs[key], key

    again = vllm_hs(cwd=tmp_path, timeout=300)
    assert again.returncode == 1
    assert "already holds an extraction; pass --resume" in again.stderr


def test_only_too_long_conversations_exit_nonzero(tmp_path: Path):
    long = {
        "messages": [
            {"role": "user", "content": "tell me everything " * 400},
            {"role": "assistant", "content": "no"},
        ]
    }
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps(long) + "\n")
    proc = vllm_hs("--data", str(data), "--output", "out", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "every conversation was skipped" in proc.stderr
    assert "vllm-hs: skipping conversation 0:" in proc.stderr
    assert "tokens > --max-length 1023 (not truncated)" in proc.stderr
    out = tmp_path / "out"
    skipped = [json.loads(x) for x in (out / SKIPPED).read_text().splitlines()]
    assert [s["index"] for s in skipped] == [0]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["samples"] == 0
    assert not list((out / HS_DIR).iterdir())


def test_merge_without_shards_fails(tmp_path: Path):
    proc = vllm_hs("--output", str(tmp_path), "--merge", cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "--merge: no shard-*-of-* directories" in proc.stderr


def test_parsing_imports_vllm_only_for_engine_options():
    """`vllm-hs --help` imports every command module and `extract --help`,
    --merge and input errors need no engine: none may import vLLM (seconds).
    Engine options pass extract's parser untouched, in order; reading them
    loads vLLM's own parser, and they land under their field names."""
    script = """
import sys
from vllm_hs.cli import build_parser
from vllm_hs.extract.engine_options import engine_options
from vllm_hs.extract.settings import ExtractSettings, RegenerateSettings
from vllm_hs.field_options import given_options, options_of

args, unknown = build_parser().parse_known_args(
    ["extract", "--output", "o", "--layers=1,-1"]
)
assert "vllm" not in sys.modules, "vllm imported"
assert unknown == [], unknown
args, unknown = build_parser().parse_known_args(
    ["extract", "--dtype", "float32", "--max-num-seqs=4", "--no-enforce-eager",
     "--seed", "3", "--max-length", "9", "--", "--max-model-len", "64"]
)
own = given_options(args, options_of(ExtractSettings, nested=False))
regenerate = given_options(args, options_of(RegenerateSettings))
assert "vllm" not in sys.modules, "vllm imported"
assert (regenerate["seed"], own["max_length"]) == (3, 9)
assert unknown[-2:] == ["--max-model-len", "64"], unknown
given = engine_options(unknown, seed=3, embedded=False)
assert "vllm" in sys.modules
assert given == {"dtype": "float32", "max_num_seqs": 4, "enforce_eager": False,
                 "max_model_len": 64, "seed": 3}, given
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_engine_options_reach_the_engine_and_modes_follow_the_umask(tmp_path: Path):
    """`--dtype bfloat16` (a vLLM option, given directly) overrides the embedded
    model's float32 default: the manifest's model dtype says bfloat16, and
    `--storage-dtype fp8` stores the fp8 layout. Every file and directory gets
    the mode the umask gives (027: 0640 and 0750), hs files included."""
    conversations, _ = load_conversations(shipped_conversations_path())
    data = tmp_path / "few.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in conversations[:4])
    )
    proc = vllm_hs(
        "--data", str(data), "--output", "out", "--dtype", "bfloat16",
        "--storage-dtype", "fp8",
        "--max-num-seqs", "2", "--", "--max-num-batched-tokens", "512",
        cwd=tmp_path, umask=0o027,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] and manifest["samples"] == 4
    assert (manifest["dtype"], manifest["model_dtype"]) == ("float8_e4m3fn", "bfloat16")
    options = manifest["engine_options"]
    assert options["dtype"] == "bfloat16" and options["max_num_seqs"] == 2
    assert options["max_num_batched_tokens"] == 512
    assert options["enforce_eager"] is True  # the embedded default stays
    from safetensors.torch import load_file

    stored = load_file(str(out / HS_DIR / "hs_0.safetensors"))
    assert stored["hidden_states"].dtype == torch.float8_e4m3fn
    assert stored["hidden_states_scales"].dtype == torch.float32
    modes = {
        p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
        for p in [out, *out.rglob("*")]
    }
    names = set(modes)
    assert {"out/vllm_hs_extract.json", "out/hidden_states/hs_3.safetensors"} <= names
    assert {"out/token_freq.pt", "out/skipped.jsonl", "out/state.json"} <= names
    assert any(name.endswith(".arrow") for name in names)
    expected = {n: 0o750 if (tmp_path / n).is_dir() else 0o640 for n in modes}
    assert modes == expected
