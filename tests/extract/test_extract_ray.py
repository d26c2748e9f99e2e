"""`vllm-hs extract --ray` as users run it: a subprocess that starts a local Ray
cluster with two replicas (two patched engines in Ray Data actors). Killed
mid-way (the driver's whole process group) and resumed, or with one replica
killed under it, it writes what a single-process run writes: same token ids,
loss masks and tensors in the same rows (hidden states to the last bits, see
`test_extract_cli.assert_same_extraction`), same manifest settings."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_extract_cli import assert_same_extraction, digests, vllm_hs

from vllm_hs.extract.cli import DEFAULT_OUTPUT
from vllm_hs.extract.inputs import load_conversations, shipped_conversations_path
from vllm_hs.extract.manifest import FINGERPRINT_KEYS
from vllm_hs.extract.records import HS_DIR, MANIFEST
from vllm_hs.patched_vllm import expect_patched

NUM = 300  # conversations shipped with vllm-hs
RAY = ("--ray", "--replicas", "2", "--ray-batch-size", "8")

pytestmark = pytest.mark.skipif(
    not expect_patched()
    and subprocess.run(
        [sys.executable, "-c", "import ray.data"], capture_output=True
    ).returncode,
    reason="ray is not installed (vllm-hs[ray])",
)


@pytest.fixture(scope="module")
def clean(llm, run_extract, tmp_path_factory) -> Path:
    """The single-process run: the same extraction in one go (in-process
    engine, same layers, dtype and eager mode as the CLI's embedded defaults)."""
    conversations, sha = load_conversations(shipped_conversations_path())
    output = tmp_path_factory.mktemp("clean") / "out"
    run_extract(llm, conversations, output, data_sha256=sha)
    return output


def _written(output: Path) -> int:
    hs_dir = output / HS_DIR
    return len(list(hs_dir.glob("hs_*.safetensors"))) if hs_dir.is_dir() else 0


def _run_until(
    tmp_path: Path, when: Callable[[int], bool], act: Callable[[subprocess.Popen], None]
) -> subprocess.Popen:
    """Start `vllm-hs extract --ray ...` in its own process group; call ``act``
    once ``when(samples written)`` holds; return the finished process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_hs", "extract", *RAY, "--no-progress"],
        cwd=tmp_path,
        stdout=(tmp_path / "stdout").open("w"),
        stderr=(tmp_path / "stderr").open("w"),
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    acted = False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if not acted and when(_written(tmp_path / DEFAULT_OUTPUT)):
                act(proc)
                acted = True
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert acted, "the run ended before the test could act on it"
    return proc


def _replica_lines(stdout: str) -> list[tuple[str, int]]:
    """(host:pid, samples) of each 'replica ...' summary line."""
    return [
        (m[1], int(m[2]))
        for m in re.finditer(
            r"^replica (\S+): (\d+) samples, \d+ tokens in [\d.]+ s, [\d,]+ tokens/s$",
            stdout,
            re.M,
        )
    ]


def _assert_same_dataset(out: Path, clean: Path) -> None:
    assert_same_extraction(out, clean)
    assert len(digests(clean)) == NUM + 2
    assert not [p for p in out.rglob(".*")], "temp files left behind"
    ours, theirs = (json.loads((d / MANIFEST).read_text()) for d in (out, clean))
    for key in (*FINGERPRINT_KEYS, "samples", "tokens", "bytes", "columns"):
        assert ours[key] == theirs[key], key
    assert ours["complete"]


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the run's session (the driver, the local Ray
    cluster, the replicas, which Ray puts in process groups of their own, and
    their engines), as if the machine went down, and wait until all are gone."""
    import psutil

    os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        alive = []
        for other in psutil.process_iter(["status"]):
            try:
                if (
                    os.getsid(other.pid) == proc.pid
                    and other.info["status"] != psutil.STATUS_ZOMBIE
                ):
                    other.kill()
                    alive.append(other.pid)
            except (OSError, psutil.Error):
                continue  # gone meanwhile
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of the killed run still alive: {alive}")


def test_killed_ray_run_resumes_to_the_samples_of_a_single_process_run(
    tmp_path: Path, clean: Path
):
    """Kill the whole run (driver, local Ray cluster, replicas and their
    engines) once 40 samples are on disk, then --resume on Ray."""
    proc = _run_until(tmp_path, lambda n: n >= 40, _kill_session)
    assert proc.returncode == -signal.SIGKILL
    out = tmp_path / DEFAULT_OUTPUT
    assert not json.loads((out / MANIFEST).read_text())["complete"]
    before = _written(out)
    assert 40 <= before < NUM

    resumed = vllm_hs("--resume", *RAY, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"vllm-hs: resuming: {before} of {NUM} samples" in resumed.stderr
    assert f"wrote {NUM - before} samples" in resumed.stdout
    assert f"dataset: {NUM} samples" in resumed.stdout
    replicas = _replica_lines(resumed.stdout)
    assert 1 <= len(replicas) <= 2, resumed.stdout
    assert sum(n for _, n in replicas) == NUM - before
    _assert_same_dataset(out, clean)


def test_a_killed_replica_is_restarted_and_its_batch_redone(
    tmp_path: Path, clean: Path
):
    """SIGKILL one replica's actor process once 16 samples are on disk: Ray Data
    restarts it and redoes its batch; the run completes to the same samples."""
    killed: list[int] = []

    def kill_a_replica(proc: subprocess.Popen) -> None:
        found = subprocess.run(
            ["pgrep", "-s", str(proc.pid), "-f", "MapWorker"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert found, "no replica process found"
        killed.append(int(found[0]))
        os.kill(killed[0], signal.SIGKILL)

    proc = _run_until(tmp_path, lambda n: n >= 16, kill_a_replica)
    stdout = (tmp_path / "stdout").read_text()
    assert proc.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    assert f"wrote {NUM} samples" in stdout
    # The samples the killed replica had done but not yet reported were redone
    # elsewhere: which replicas report, and how many, depends on timing.
    replicas = _replica_lines(stdout)
    assert replicas, stdout
    assert sum(n for _, n in replicas) == NUM
    _assert_same_dataset(tmp_path / DEFAULT_OUTPUT, clean)
