"""What the engine suites share: their settings, the seeded models, the
engine's arguments, and the workload process each measurement runs in
(`benchmarks.workload`)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.machine import REPO_ROOT
from benchmarks.protocol import option
from benchmarks.result import Result, Summary, memory_summary

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "large": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 8192,
    },
}
"""The seeded models by name (`vllm_hs.models.tiny.build_tiny_model` sizes;
tiny: hidden 128, 4 layers)."""


@dataclass
class EngineSettings:
    model: str = option(
        "large",
        "tiny: seeded hidden 128, 4 layers; large: seeded hidden 512, 8 layers, "
        "vocab 8192; or a model directory, e.g. a real model's config with "
        "--load-format dummy on a GPU (engine suites: large; extraction, "
        "ray_extract: tiny; acceptance: the structured target)",
    )
    mode: str = option(
        "mp", "engine mode: mp (vLLM's multiprocess engine, default) or inproc"
    )
    prompts: int = option(32, "prompts per batch")
    prompt_len: int = option(256, "tokens per prompt")
    max_tokens: int = option(32, "tokens generated")
    rounds: int = option(4, "rounds, sides alternating (default: each suite's own)")
    dtype: str = option("bfloat16", "engine dtype (default: each suite's own)")
    eager: bool = option(
        True, "use the compiled engine instead of enforce_eager", flag="--compile"
    )
    unpatched_python: str | None = option(
        None,
        "python of an environment with the UNPATCHED wheel of the same release "
        "(needed by the overhead suites)",
    )
    load_format: str = option(
        "auto", "vLLM load_format; 'dummy' needs only config.json"
    )

    def __post_init__(self) -> None:
        if self.mode not in ("mp", "inproc"):
            raise SystemExit(f"--mode: mp or inproc, not {self.mode!r}")


def model_dir(settings: EngineSettings) -> tuple[str, dict[str, int]]:
    """A built seeded model ("tiny", "large"), or any model directory (e.g. a
    real model's config with --load-format dummy, on a GPU)."""
    if settings.model not in MODELS:
        config = json.loads((Path(settings.model) / "config.json").read_text())
        config = config.get("text_config", config)
        sizes = {
            "num_hidden_layers": int(config["num_hidden_layers"]),
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": int(config["hidden_size"]),
        }
        return settings.model, sizes
    return seeded_model(settings.model), MODELS[settings.model]


def require_seeded(model: str) -> None:
    """Refuse a --model that is not a seeded model's name (MODELS)."""
    if model not in MODELS:
        raise SystemExit(f"--model: one of {sorted(MODELS)}, not {model!r}")


def seeded_model(name: str, **overrides: int) -> str:
    """The directory of seeded model `name` (MODELS), built once (float32)."""
    from vllm_hs.models.tiny import build_tiny_model

    return str(build_tiny_model("llama", "float32", **MODELS[name], **overrides))


def cpu_engine_kwargs() -> dict[str, Any]:
    """On CPU, a KV cache size (vLLM's memory share is a GPU's); on a GPU none."""
    try:
        import torch

        on_gpu = torch.cuda.is_available()
    except ImportError:
        on_gpu = False
    return {} if on_gpu else {"kv_cache_memory_bytes": 1 << 30}


def engine_kwargs(settings: EngineSettings, layers: list[Any] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": settings.dtype,
        "max_model_len": settings.prompt_len + settings.max_tokens + 16,
        "enforce_eager": settings.eager,
        "load_format": settings.load_format,
        # Rounds repeat the same prompts: with prefix caching, plain requests
        # would skip work that a prompt-state request does unless the
        # AuxOutput store holds the hit's rows (`store_bytes`).
        "enable_prefix_caching": False,
        "seed": 0,
        **cpu_engine_kwargs(),
    }
    if layers is not None:
        kwargs["hidden_states_config"] = {"layers": layers}
    return kwargs


def four_layers(sizes: dict[str, int]) -> list[Any]:
    num_layers = sizes.get("num_hidden_layers", 4)
    return list(dict.fromkeys([1, num_layers // 2, num_layers - 1, num_layers]))


def dtype_bytes(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2)


def run_workload(
    python: str, spec: dict[str, Any], module: str = "benchmarks.workload"
) -> dict[str, Any]:
    """Run `python -m module '<spec json>'` from the repository root
    and return the JSON it prints on its `WORKLOAD_RESULT ` line."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "HF_HUB_OFFLINE": "1",
        **spec.get("env", {}),
    }
    proc = subprocess.run(
        [python, "-m", module, json.dumps(spec)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("WORKLOAD_RESULT "):
            return json.loads(line.removeprefix("WORKLOAD_RESULT "))
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
    raise RuntimeError(f"workload failed (exit {proc.returncode}):\n{tail}")


def workload_spec(
    settings: EngineSettings, path: str, sizes: dict[str, int], **overrides: Any
) -> dict[str, Any]:
    """A `benchmarks.workload` spec: the settings' batch on model `path` (of
    `sizes`, as model_dir gives them) on an engine without
    hidden_states_config, one round of plain requests, unless overridden."""
    spec = {
        "model": path,
        "vocab": sizes.get("vocab_size", 1024),
        "mode": settings.mode,
        "prompts": settings.prompts,
        "prompt_len": settings.prompt_len,
        "max_tokens": settings.max_tokens,
        "rounds": 1,
        "variants": {"plain": None},
        "engine": engine_kwargs(settings, None),
    }
    spec.update(overrides)
    return spec


def engine_result(
    name: str,
    description: str,
    settings: EngineSettings,
    rounds: list[dict[str, Any]],
    summary: Summary,
    memory: dict[str, list[dict[str, Any]]] | None = None,
    **extra_settings: Any,
) -> Result:
    """An engine suite's result: its settings with the suite's own."""
    return Result(
        suite=name,
        description=description,
        settings={**asdict(settings), **extra_settings},
        rounds=rounds,
        summary=summary,
        memory=memory_summary(memory) if memory else {},
    )
