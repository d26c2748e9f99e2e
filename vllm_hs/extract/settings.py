"""The settings of one extraction, `ExtractSettings`: built and checked once
(by the command line, `vllm_hs.extract.cli`, or a library caller), then handed
unchanged to the single-process run (`vllm_hs.extract.job.extract`) and the Ray
run (`vllm_hs.extract.on_ray.extract_on_ray`). The manifest
(`vllm_hs.extract.manifest`) and the engine loop's settings
(`vllm_hs.extract.loop.LoopSettings`) derive from it.

Each `vllm-hs extract` option is declared once, on the field it sets
(`vllm_hs.field_options.option`: flag, help, parsing, check, default); the
command line is generated from these declarations. Fields marked `RECORDED` are
copied into the manifest under their own names.

What needs the model is settled where the model is known, by
`ExtractSettings.for_model`: the layer ids (``-1`` -> L, the trainer format's
default when not given, their range); --max-length against the engine's
context is checked by `vllm_hs.extract.job.prepare`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.formats import FORMATS, SampleFiles, sample_files
from vllm_hs.extract.storage import FP8, STORAGE_CHOICES, stored_dtype
from vllm_hs.field_options import integer, number, option
from vllm_hs.input_checks import (
    existing_path,
    model_problem,
    new_or_writable_dir,
    read_text_file,
)
from vllm_hs.layer_ids import LayerId, check_layer_ids, split_layer_ids

__all__ = [
    "DEFAULT_OUTPUT",
    "RECORDED",
    "ExtractSettings",
    "RayOptions",
    "RegenerateSettings",
]

#: --output's default.
DEFAULT_OUTPUT = Path("vllm-hs-extract-out")
#: --buffer-mib's default.
DEFAULT_BUFFER_MIB = 2048
_RECORDED_KEY = "vllm_hs.manifest"
#: Field metadata: the manifest records the field under its name.
RECORDED = {_RECORDED_KEY: True}


def _layer_ids(text: str) -> tuple[LayerId, ...]:
    return tuple(split_layer_ids(text))


def _mib(text: str) -> int:
    return integer(text) << 20


@dataclasses.dataclass(frozen=True)
class RegenerateSettings:
    """The --regenerate options (``manifest.regenerate``; null without it)."""

    max_new_tokens: int = option(
        "--regenerate: tokens per generated turn (default: %(default)s)",
        default=256,
        metavar="N",
        parse=integer,
    )
    temperature: float = option(
        "--regenerate: sampling temperature (default: %(default)s = greedy); "
        "above 0 each conversation n samples with seed --seed + n, so reruns and "
        "--resume reproduce it",
        default=0.0,
        metavar="T",
        parse=number,
    )
    seed: int = option(
        "base sampling seed of --regenerate, and vLLM's engine --seed "
        "(default: %(default)s)",
        default=0,
        metavar="N",
        parse=integer,
    )
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
    replicas: int = option(
        "--ray: engines to run, one per Ray actor, each with the engine options "
        "given (default: %(default)s)",
        default=1,
        metavar="N",
        parse=integer,
    )
    batch_size: int | None = option(
        "--ray: samples a replica takes at a time (default: a quarter of each "
        "replica's share, at most 64)",
        default=None,
        flag="--ray-batch-size",
        metavar="N",
        parse=integer,
    )

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise VllmHsError("--replicas must be at least 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise VllmHsError("--ray-batch-size must be at least 1")


@dataclasses.dataclass(frozen=True)
class ExtractSettings:
    """Everything an extraction is told (one field per `vllm-hs extract` option
    it uses, declared there). Construction checks what can be checked without
    the model; `for_model` settles the rest."""

    output: Path = option(
        "output directory (default: ./%(default)s); must be new or empty unless "
        "--resume",
        metavar="DIR",
        parse=Path,
        check=new_or_writable_dir,
        command_line_default=str(DEFAULT_OUTPUT),
    )
    """This shard's directory (`vllm_hs.extract.outdir.shard_dir` when sharded)."""
    layers: tuple[LayerId, ...] | None = option(
        "comma-separated layer ids, last = the verifier's last hidden state, "
        "e.g. 2,16,29,32 (default: speculators' [2, L//2, L-3, L]; models with "
        "fewer than 8 layers: three aux layers spread over 1..L-1, then L)",
        metavar="IDS",
        parse=_layer_ids,
        command_line_default=None,
        metadata=RECORDED,
    )
    """Layer id of each hidden_states column (`vllm_hs.layer_ids`; ``-1`` for
    L), None for the trainer format's default; `for_model` resolves them."""
    data_sha256: str = dataclasses.field(metadata=RECORDED)
    """SHA-256 of the normalized input conversations (all shards; identifies
    the input for --resume)."""
    model: str | None = option(
        "model directory or HF id, vLLM's --model (default: the embedded tiny "
        "seeded Llama, built once into the vllm-hs cache, run in float32 and eager "
        "mode)",
        default=None,
        metavar="DIR",
        check=model_problem,
    )
    """The model the engines run (the command line and Ray start them); None
    when the caller passes its own engine."""
    data: str | None = option(
        "JSONL of conversations (OpenAI 'messages' or ShareGPT 'conversations' "
        "per line) or a saved HF datasets directory (default: the conversation "
        "set shipped with vllm-hs)",
        default=None,
        metavar="FILE",
        parse=Path,
        check=existing_path,
        metadata=RECORDED,
    )
    """--data as a path, recorded in the manifest."""
    engine_options: dict[str, Any] | None = dataclasses.field(
        default=None, metadata=RECORDED
    )
    """vLLM engine options (EngineArgs fields) of the engines started from
    ``model``; recorded in the manifest."""
    max_length: int | None = option(
        "longest sample in tokens; longer conversations are skipped and reported, "
        "never truncated (default: the engine's max_model_len - 1)",
        default=None,
        metavar="N",
        parse=integer,
    )
    """Longest sample in tokens (None: the engine's max_model_len - 1)."""
    regenerate: RegenerateSettings | None = option(
        "let the model write the assistant turns (each turn in order, given the "
        "conversation so far; a trailing user message is answered too) and store "
        "the states of the last turn's request: prompt + generated tokens",
        default=None,
        switch=True,
        nested=RegenerateSettings,
        metadata=RECORDED,
    )
    num_shards: int = option(
        "split the work over S machines/processes (default: %(default)s)",
        default=1,
        metavar="S",
        parse=integer,
        metadata=RECORDED,
    )
    shard_index: int = option(
        "this shard, 0..S-1: takes conversations n with n %% S == I and writes "
        "OUTPUT/shard-IIIII-of-SSSSS/ (default: %(default)s)",
        default=0,
        metavar="I",
        parse=integer,
        metadata=RECORDED,
    )
    resume: bool = option(
        "continue an interrupted run in OUTPUT (same model, data and options): "
        "finished samples are kept, the rest is extracted",
        default=False,
    )
    chat_template: str | None = option(
        "Jinja chat template file to use instead of the tokenizer's",
        default=None,
        metavar="FILE",
        parse=read_text_file,
    )
    """Template text replacing the tokenizer's (--chat-template)."""
    validate: bool = option(
        "skip the NaN/Inf scan of every sample (row count, layer count and hidden "
        "size are always checked)",
        default=True,
        flag="--no-validate",
        metadata=RECORDED,
    )
    storage_dtype: str = option(
        "dtype of hidden_states in the hs files: auto = the model's; "
        "bfloat16/float16 round each value (a sample beyond float16's range is "
        "rejected); fp8 = speculators' FP8 layout (float8_e4m3fn with a float32 "
        "scale per token in hidden_states_scales; read it through hs-connectors' "
        "FP8Transfer, see below) (default: %(default)s)",
        default="auto",
        choices=STORAGE_CHOICES,
    )
    trainer_format: str = option(
        "the trainer whose offline format to write (see below): speculators "
        "(default), specforge or modelopt",
        default="speculators",
        flag="--format",
        choices=FORMATS,
        metadata=RECORDED,
    )
    compress: bool = option(
        "--format specforge: gzip each sample (.ckpt.gz)",
        default=False,
        metadata=RECORDED,
    )
    buffer_bytes: int = option(
        "host memory for states in flight or waiting to be written (default: "
        "%(default)s MiB)",
        default=DEFAULT_BUFFER_MIB << 20,
        flag="--buffer-mib",
        metavar="MIB",
        parse=_mib,
        command_line_default=str(DEFAULT_BUFFER_MIB),
    )
    """At most this much memory for states in flight or waiting to be written
    (per engine)."""
    ray: RayOptions | None = option(
        "run on Ray (needs vllm-hs[ray]): without ADDRESS on a local Ray cluster "
        "started for the run; 'auto', HOST:PORT or ray://HOST:PORT joins an "
        "existing one. OUTPUT must be on a file system every node sees at the same "
        "path (see below)",
        default=None,
        metavar="ADDRESS",
        const="local",
        nested=RayOptions,
    )
    """None: one engine in this process."""
    progress: bool = option("no progress bar", default=True, flag="--no-progress")
    files: SampleFiles = dataclasses.field(init=False, repr=False, compare=False)
    """The trainer format's `SampleFiles` (from ``trainer_format``, ``compress``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "output", Path(self.output))
        if self.layers is not None:
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
        if self.resolved:
            files.check_layers(self.layers)
        if self.storage_dtype == "fp8" and not files.stores_fp8:
            raise VllmHsError(
                f"--storage-dtype fp8 is speculators' layout; {files.name} cannot "
                "read its scales (use bfloat16)"
            )

    @property
    def resolved(self) -> bool:
        """Whether ``layers`` are final: given, and without ``-1``."""
        return self.layers is not None and -1 not in self.layers

    def for_model(self, num_hidden_layers: int) -> ExtractSettings:
        """These settings for a model of ``num_hidden_layers`` decoder layers: the
        layer ids resolved (``-1`` -> L, checked against the model; the trainer
        format's default when not given), then checked for the trainer format.
        The one place layer ids meet the model; `vllm_hs.extract.job.prepare`
        calls it, and the command line before it starts its engines."""
        if self.layers is None:
            layers = self.files.default_layers(num_hidden_layers)
        else:
            layers = check_layer_ids(self.layers, num_hidden_layers)
        if tuple(layers) == self.layers:
            return self
        return dataclasses.replace(self, layers=tuple(layers))

    def recorded(self) -> dict[str, Any]:
        """The fields the manifest records (marked `RECORDED`), by name."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata.get(_RECORDED_KEY)
        }

    def stored_dtype(self, model_dtype: str) -> str:
        """torch dtype name of hidden_states in the files, for a model of
        ``model_dtype``."""
        stored = stored_dtype(self.storage_dtype, model_dtype)
        assert stored != FP8 or self.files.stores_fp8
        return stored
