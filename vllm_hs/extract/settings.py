"""The settings of one extraction, `ExtractSettings`: built and checked once
(by the command line, `vllm_hs.extract.cli`, or a library caller), then handed
unchanged to the single-process run (`vllm_hs.extract.job.extract`) and the Ray
run (`vllm_hs.extract.on_ray.extract_on_ray`). The manifest
(`vllm_hs.extract.manifest`) and the engine loop's settings
(`vllm_hs.extract.loop.LoopSettings`) derive from it.

What needs the model is checked where the model is known: the layer ids'
range (`vllm_hs.layer_ids.parse_layers`, in the command line) and --max-length
against the engine's context (`vllm_hs.extract.job.prepare`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.formats import SampleFiles, sample_files
from vllm_hs.extract.storage import FP8, STORAGE_CHOICES, stored_dtype
from vllm_hs.layer_ids import LayerId

__all__ = ["ExtractSettings", "RayOptions", "RegenerateSettings"]


@dataclasses.dataclass(frozen=True)
class RegenerateSettings:
    """The --regenerate options (``manifest.regenerate``; null without it)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    """Conversation n samples with seed ``seed + n`` when temperature > 0."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise VllmHsError("--max-new-tokens must be positive")


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """--ray: where and how wide (`vllm_hs.extract.on_ray`)."""

    address: str | None = None
    """None: a local cluster started for the run; else "auto", HOST:PORT or
    ray://HOST:PORT."""
    replicas: int = 1
    batch_size: int | None = None
    """Samples a replica takes at a time (None: a quarter of each replica's
    share, at most 64)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise VllmHsError("--replicas must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise VllmHsError("--ray-batch-size must be at least 1")


@dataclasses.dataclass(frozen=True)
class ExtractSettings:
    """Everything an extraction is told (one field per `vllm-hs extract` option
    it uses). Construction checks what can be checked without the model."""

    output: Path
    """This shard's directory (`vllm_hs.extract.outdir.shard_dir` when sharded)."""
    layers: tuple[LayerId, ...]
    """Layer id of each hidden_states column (`vllm_hs.layer_ids`), resolved
    against the model (``-1`` already ``L``)."""
    data_sha256: str
    """SHA-256 of the normalized input conversations (all shards; identifies
    the input for --resume)."""
    data: str | None = None
    """--data as a path, recorded in the manifest."""
    model: str | None = None
    """The model the engines run (the command line and Ray start them); None
    when the caller passes its own engine."""
    engine_options: dict[str, Any] | None = None
    """vLLM engine options (EngineArgs fields) of the engines started from
    ``model``; recorded in the manifest."""
    max_length: int | None = None
    """Longest sample in tokens (None: the engine's max_model_len - 1)."""
    regenerate: RegenerateSettings | None = None
    num_shards: int = 1
    shard_index: int = 0
    resume: bool = False
    chat_template: str | None = None
    """Template text replacing the tokenizer's (--chat-template)."""
    validate: bool = True
    storage_dtype: str = "auto"
    trainer_format: str = "speculators"
    compress: bool = False
    buffer_bytes: int = 2 << 30
    """At most this much memory for states in flight or waiting to be written
    (per engine)."""
    progress: bool = True
    ray: RayOptions | None = None
    """None: one engine in this process."""
    files: SampleFiles = dataclasses.field(init=False, repr=False, compare=False)
    """The trainer format's `SampleFiles` (from ``trainer_format``, ``compress``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", Path(self.output))
        object.__setattr__(self, "layers", tuple(self.layers))
        if not 0 <= self.shard_index < self.num_shards:
            raise VllmHsError(
                f"--shard-index must be in 0..{self.num_shards - 1} (--num-shards "
                f"{self.num_shards})"
            )
        if self.max_length is not None and self.max_length < 1:
            raise VllmHsError("--max-length must be positive")
        if self.storage_dtype not in STORAGE_CHOICES:
            raise VllmHsError(f"--storage-dtype must be one of {STORAGE_CHOICES}")
        if self.ray is not None and self.model is None:
            raise VllmHsError("--ray starts its own engines: it needs the model")
        files = sample_files(self.trainer_format, self.compress)
        object.__setattr__(self, "files", files)
        files.check_layers(self.layers)
        if self.storage_dtype == "fp8" and not files.stores_fp8:
            raise VllmHsError(
                f"--storage-dtype fp8 is speculators' layout; {files.name} cannot "
                "read its scales (use bfloat16)"
            )

    def stored_dtype(self, model_dtype: str) -> str:
        """torch dtype name of hidden_states in the files, for a model of
        ``model_dtype``."""
        stored = stored_dtype(self.storage_dtype, model_dtype)
        assert stored != FP8 or self.files.stores_fp8
        return stored
