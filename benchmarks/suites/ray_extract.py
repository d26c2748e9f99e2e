"""`vllm-hs extract --ray` against the same extraction without Ray: throughput
with 1 and 2 replicas, and what Ray adds per sample and per run.

    python -m benchmarks run ray_extract [--model tiny|large] [--rounds 3]

Each round runs the CLI as users do (a subprocess, vLLM's default multiprocess
engine, the shipped conversations, a fresh output directory) three ways, in
rotating order: without Ray (`plain`), `--ray --replicas 1` and `--ray
--replicas 2` (a local Ray cluster started by the run). From each run's
summary: the wall time of the whole command, the extraction's time (`wrote ...
in S s`: for Ray from the pipeline's start, replica engine starts included)
and, for Ray, each replica's busy time (its batches: engine loop and writes).

Figures (median [min, max] over rounds):

- `replicas2_over_replicas1`: tokens/s of the extraction, 2 replicas / 1. On a
  2-core machine both engines share the cores: no gain is expected; the point
  is that the path runs.
- `busy_overhead_per_sample_s`: (replica busy time with 1 replica - the plain
  run's loop time) / samples: what batching through Ray costs per sample once
  the engine runs (a batch's tail drains before the next batch starts, batches
  are pickled).
- `fixed_overhead_s`: (wall with 1 replica - its busy time) - (plain wall -
  plain loop time): what Ray adds once per run (the cluster, the actor, its
  engine's start in another process).

Writes benchmarks/results/v<vllm version>/ray_extract.json.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, Summary, spread
from benchmarks.rounds import run_rounds
from benchmarks.suites.engine import require_seeded, seeded_model


@dataclass
class RayExtractSettings:
    model: str = option("tiny", "")
    rounds: int = option(3, "")

    def __post_init__(self) -> None:
        require_seeded(self.model)


SIDES: dict[str, list[str]] = {
    "plain": [],
    "replicas1": ["--ray", "--replicas", "1"],
    "replicas2": ["--ray", "--replicas", "2"],
}

_WROTE = re.compile(r"^wrote (\d+) samples \((\d+) tokens\) in ([\d.]+) s", re.M)
_REPLICA = re.compile(
    r"^replica (\S+): (\d+) samples, (\d+) tokens in ([\d.]+) s", re.M
)


def _run(side: str, model_args: list[str], work: Path) -> dict[str, Any]:
    out = work / side
    command = [
        sys.executable,
        "-m",
        "vllm_hs",
        "extract",
        "--output",
        str(out),
        "--no-progress",
        *SIDES[side],
        *model_args,
    ]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
    wrote = _WROTE.search(proc.stdout)
    assert wrote, proc.stdout
    replicas = [
        {
            "replica": m[1],
            "samples": int(m[2]),
            "tokens": int(m[3]),
            "busy_s": float(m[4]),
        }
        for m in _REPLICA.finditer(proc.stdout)
    ]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {
        "wall_s": wall,
        "samples": int(wrote[1]),
        "tokens": int(wrote[2]),
        "extract_s": float(wrote[3]),
        "tokens_per_s": int(wrote[2]) / float(wrote[3]),
        "replicas": replicas,
        "busy_s": sum(r["busy_s"] for r in replicas),
    }


def measure(args: RayExtractSettings) -> list[Result]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm

    model_args: list[str] = []
    if args.model != "tiny":
        model_args = [
            "--model",
            seeded_model(args.model),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(1 << 30),
        ]
    work = Path(tempfile.mkdtemp(prefix="vllm-hs-ray-bench-"))
    names = list(SIDES)
    sides = {side: _side(side, model_args, work) for side in names}
    rounds: list[dict[str, Any]] = []
    for r, measured in enumerate(run_rounds(args.rounds, sides)):
        row: dict[str, Any] = {"round": r}
        for side, record in measured.items():
            row[side] = record
            print(f"round {r} {side}: {record}", flush=True)
        plain, one, two = row["plain"], row["replicas1"], row["replicas2"]
        samples = plain["samples"]
        row["replicas2_over_replicas1"] = two["tokens_per_s"] / one["tokens_per_s"]
        row["busy_overhead_per_sample_s"] = (
            one["busy_s"] - plain["extract_s"]
        ) / samples
        row["fixed_overhead_s"] = (one["wall_s"] - one["busy_s"]) - (
            plain["wall_s"] - plain["extract_s"]
        )
        rounds.append(row)
    ratio = spread([r["replicas2_over_replicas1"] for r in rounds])
    figures = {
        key: spread([r[key] for r in rounds])
        for key in (
            "replicas2_over_replicas1",
            "busy_overhead_per_sample_s",
            "fixed_overhead_s",
        )
    }
    for side in names:
        figures[f"{side}_wall_s"] = spread([r[side]["wall_s"] for r in rounds])
        figures[f"{side}_tokens_per_s"] = spread(
            [r[side]["tokens_per_s"] for r in rounds]
        )
    print(figures, flush=True)
    result = Result(
        suite="ray_extract" if args.model == "tiny" else f"ray_extract-{args.model}",
        description=(__doc__ or "").split("\n\n")[0],
        settings={
            "model": args.model,
            "rounds": args.rounds,
            "sides": SIDES,
            "vllm": vllm.__version__,
        },
        rounds=rounds,
        summary=Summary(
            metric="extraction tokens/s with --ray --replicas 2 / --replicas 1 "
            "(other figures in figures)",
            higher_is_better=True,
            aim=None,
            **ratio,
        ),
        extra={"figures": figures},
    )
    return [result]


def _side(side: str, model_args: list[str], work: Path) -> Callable[[], dict[str, Any]]:
    return lambda: _run(side, model_args, work)
