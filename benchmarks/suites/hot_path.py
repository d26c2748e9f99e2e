"""The channel's own output path of a step's rows, before and after a change:
the worker's gather (and copy to the host on a GPU), its placement of each
request's rows, and the rows pickled to the engine core and unpickled there as
vLLM's message queue does it (out-of-band buffers, a copy out of the ring).
Driven with the real `HiddenStatesWorker` of each side's vLLM, in a process of
its own (`benchmarks.hot_path_probe`), on the large bench model's shape: every
layer (0..L) of the whole prompts of `requests` requests per step, which sample
at its end. The forward pass and the IPC transfer itself are left out (they are
the same on both sides; `transport` measures them end to end).

Per step: seconds of each stage, the bytes the channel's code writes (tensor
copies in prepare and commit), out-of-band bytes, minor page faults (memory
touched for the first time). The figure: memcpy time of the step's rows /
the channel's time per step (after; before alongside).

    python -m benchmarks run hot_path [--baseline-site DIR]

`--baseline-site`: a folder with another vLLM wheel unpacked (`pip install
--no-deps --target DIR WHEEL`), the "before" side; without it only the
installed vLLM runs.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Any

from benchmarks.machine import REPO_ROOT
from benchmarks.protocol import option
from benchmarks.result import Result, summarize
from benchmarks.rounds import run_rounds
from benchmarks.suites.engine import MODELS, run_workload

STAGES = ("prepare_s", "commit_s", "pickle_s", "unpickle_s", "total_s")


@dataclass
class HotPathSettings:
    requests: int = option(16, "requests per step (whole prompts)")
    prompt_len: int = option(256, "tokens per prompt")
    steps: int = option(12, "steps per side and round (the first is a warm-up)")
    dtype: str = option("bfloat16", "engine dtype (default: each suite's own)")
    rounds: int = option(5, "")
    baseline_site: str | None = option(
        None, "folder with the 'before' vLLM wheel unpacked (pip install --target)"
    )


def _side(settings: HotPathSettings, site: str | None) -> dict[str, Any]:
    sizes = MODELS["large"]
    spec: dict[str, Any] = {
        "dtype": settings.dtype,
        "num_hidden_layers": sizes["num_hidden_layers"],
        "hidden_size": sizes["hidden_size"],
        "requests_per_step": settings.requests,
        "prompt_len": settings.prompt_len,
        "steps": settings.steps,
    }
    if site is not None:
        spec["env"] = {"PYTHONPATH": f"{site}:{REPO_ROOT}"}
    out = run_workload(sys.executable, spec, module="benchmarks.hot_path_probe")
    steps = out["steps"]
    measured = steps[1:]
    medians = {k: statistics.median(s[k] for s in measured) for k in STAGES}
    memcpy_s = out["state_bytes_per_step"] / out["memcpy_bytes_per_s"]
    return {
        "vllm": out["vllm"],
        "distribution": out["distribution"],
        **medians,
        "memcpy_s": memcpy_s,
        "ratio": memcpy_s / medians["total_s"],
        "state_bytes_per_step": out["state_bytes_per_step"],
        "channel_bytes_written_per_step": steps[0]["channel_bytes_written"],
        "out_of_band_bytes_per_step": measured[0]["out_of_band_bytes"],
        "minor_faults_per_step": statistics.median(s["minor_faults"] for s in measured),
    }


def measure(settings: HotPathSettings) -> list[Result]:
    sides = {"after": lambda: _side(settings, None)}
    if settings.baseline_site:
        sides["before"] = lambda: _side(settings, settings.baseline_site)
    rounds = []
    for i, got in enumerate(run_rounds(settings.rounds, sides)):
        rounds.append({"round": i, **got})
        line = ", ".join(
            f"{name} ({side['distribution']}) {side['total_s'] * 1e3:.2f} ms/step "
            f"({side['ratio']:.3f} of memcpy, "
            f"{side['channel_bytes_written_per_step'] / 2**20:.0f} MiB written, "
            f"{side['minor_faults_per_step']:.0f} faults)"
            for name, side in got.items()
        )
        print(f"  round {i}: {line}", flush=True)
    sizes = MODELS["large"]
    return [
        Result(
            suite="hot_path",
            description=(__doc__ or "").split("\n\n")[0],
            settings={
                "model": "large (its shape; torch only)",
                "layers": sizes["num_hidden_layers"] + 1,
                "hidden_size": sizes["hidden_size"],
                "requests_per_step": settings.requests,
                "prompt_len": settings.prompt_len,
                "steps": settings.steps,
                "dtype": settings.dtype,
                "baseline_site": settings.baseline_site,
            },
            rounds=rounds,
            summary=summarize(
                [r["after"]["ratio"] for r in rounds],
                "memcpy time of a step's rows / the channel's time per step "
                "(worker's gather and placement, pickling to the engine core "
                "and back)",
                higher_is_better=True,
                aim=0.25,
            ),
            extra={
                "per_step_medians": {
                    name: {
                        key: statistics.median(r[name][key] for r in rounds)
                        for key in (
                            *STAGES,
                            "memcpy_s",
                            "ratio",
                            "channel_bytes_written_per_step",
                            "out_of_band_bytes_per_step",
                            "minor_faults_per_step",
                        )
                    }
                    for name in sides
                }
            },
        )
    ]
