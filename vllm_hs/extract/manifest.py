"""OUTPUT/vllm_hs_extract.json, the `Manifest`: an extraction's settings, what
each column is, and its summary. Written first with ``complete: false``,
rewritten last with ``complete: true``; --resume and --merge compare the
`FINGERPRINT_KEYS` of manifests. `Manifest.of` derives it from the
`vllm_hs.extract.settings.ExtractSettings` (the fields it marks `RECORDED`, taken
under their own names) and the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hs import fs
from vllm_hs.errors import VllmHsError
from vllm_hs.extract.formats import SampleFiles, sample_files
from vllm_hs.extract.formats.speculators import SpeculatorsFiles
from vllm_hs.extract.records import ExtractResult
from vllm_hs.extract.settings import ExtractSettings, RegenerateSettings
from vllm_hs.extract.storage import reading_note
from vllm_hs.layer_ids import describe_layers

if TYPE_CHECKING:
    from vllm_hs.extract.engine import ModelFacts

__all__ = ["FINGERPRINT_KEYS", "FORMAT_VERSION", "Manifest"]

#: Bumped when a reader of an older output would misread a newer one.
FORMAT_VERSION = 1

#: Manifest keys that must match for --resume and --merge: the same model, input,
#: template, layers and options give the same bytes.
FINGERPRINT_KEYS = (
    "format_version",
    "model_config_sha256",
    "data_sha256",
    "chat_template_sha256",
    "layers",
    "dtype",
    "hidden_size",
    "max_length",
    "regenerate",
    "validate",
    "trainer_format",
    "compress",
)


@dataclasses.dataclass
class Manifest:
    """vllm_hs_extract.json. The JSON keys are the field names; fields that are
    None and listed in `_OPTIONAL` are left out of the JSON."""

    model: str
    """--model as given to the engine (a directory or HF id)."""
    model_config_sha256: str
    """SHA-256 of the model's config.json (of the model string without one)."""
    data_sha256: str
    """SHA-256 of the normalized input conversations (all shards)."""
    chat_template_sha256: str
    layers: list[int | str]
    """Layer id of each hidden_states column, in column order (`vllm_hs.layer_ids`)."""
    columns: dict[str, dict[str, Any]]
    """str(column) -> {"layer", "role": "aux" | "verifier_last_hidden_states",
    "what"}: the same information as ``layers``, for a human reader."""
    num_hidden_layers: int
    dtype: str
    """torch dtype name of hidden_states in the hs files, e.g. "float32",
    "bfloat16", "float8_e4m3fn" (--storage-dtype)."""
    hidden_size: int
    max_length: int
    """Longest sample in tokens; longer conversations are skipped."""
    regenerate: RegenerateSettings | None
    validate: bool
    """Whether every sample was scanned for NaN/Inf before it was written."""
    num_shards: int = 1
    shard_index: int = 0
    complete: bool = False
    """True once the dataset, token_freq.pt and skipped.jsonl are written."""
    format_version: int = FORMAT_VERSION
    format: str = SpeculatorsFiles.description
    data: str | None = None
    """--data path (CLI runs)."""
    engine_options: dict[str, Any] | None = None
    """vLLM engine options the CLI set (its defaults and the user's)."""
    samples: int | None = None
    """Summary, set when complete: dataset rows."""
    tokens: int | None = None
    bytes: int | None = None
    """Total size of the hs files."""
    skipped: int | None = None
    """Rows of skipped.jsonl."""
    rejected: int | None = None
    """Rows of skipped.jsonl with stage "validate"."""
    merged_from: list[str] | None = None
    """--merge: the shard directories this dataset was merged from."""
    model_dtype: str | None = None
    """The engine's dtype, when the files store another (--storage-dtype)."""
    reading: str | None = None
    """What a reader of these files must know beyond ``format`` (the fp8
    layout's scales; `vllm_hs.extract.storage.reading_note`)."""
    trainer_format: str = "speculators"
    """--format: the trainer whose files these are (`vllm_hs.extract.formats`)."""
    compress: bool = False
    """--compress (specforge: gzipped .ckpt.gz files)."""

    def __post_init__(self) -> None:
        # As JSON holds them (a settings' tuple of layers, an engine option that
        # is an object).
        self.layers = list(self.layers)
        if self.engine_options is not None:
            self.engine_options = _jsonable(self.engine_options)

    _OPTIONAL = (
        "data",
        "engine_options",
        "samples",
        "tokens",
        "bytes",
        "skipped",
        "rejected",
        "merged_from",
        "model_dtype",
        "reading",
    )

    @classmethod
    def of(
        cls,
        settings: ExtractSettings,
        facts: ModelFacts,
        max_length: int,
        chat_template: str | None,
    ) -> Manifest:
        """The manifest a run of ``settings`` on the model of ``facts`` starts
        with (``max_length`` resolved against the model, ``chat_template`` the
        template in use)."""
        assert settings.layers is not None, "settings.for_model() first"
        stored = settings.stored_dtype(facts.dtype)
        return cls(
            **settings.recorded(),
            model=facts.model,
            model_config_sha256=facts.fingerprint,
            chat_template_sha256=hashlib.sha256(
                (chat_template or "").encode()
            ).hexdigest(),
            columns=describe_layers(settings.layers, facts.num_hidden_layers),
            num_hidden_layers=facts.num_hidden_layers,
            dtype=stored,
            model_dtype=None if stored == facts.dtype else facts.dtype,
            reading=reading_note(stored),
            hidden_size=facts.hidden_size,
            max_length=max_length,
            format=settings.files.description,
        )

    def to_json(self) -> dict[str, Any]:
        value = dataclasses.asdict(self)
        for key in self._OPTIONAL:
            if value[key] is None:
                del value[key]
        return value

    @classmethod
    def from_json(cls, value: dict[str, Any], where: Path) -> Manifest:
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in value.items() if k in known}
        try:
            if fields.get("regenerate") is not None:
                fields["regenerate"] = RegenerateSettings(**fields["regenerate"])
            return cls(**fields)
        except TypeError as e:
            raise VllmHsError(f"{where}: not a vllm-hs extract manifest ({e})") from e

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            value = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise VllmHsError(f"{path}: not JSON ({e})") from e
        return cls.from_json(value, path)

    def write(self, path: Path) -> None:
        fs.atomic_write_json(path, self.to_json())

    def differences(self, other: Manifest) -> list[tuple[str, Any, Any]]:
        """(key, mine, other's) of the `FINGERPRINT_KEYS` that differ."""
        mine, theirs = self.to_json(), other.to_json()
        return [
            (k, mine[k], theirs[k]) for k in FINGERPRINT_KEYS if mine[k] != theirs[k]
        ]

    def files(self) -> SampleFiles:
        """The `SampleFiles` of the trainer format these files are in."""
        return sample_files(self.trainer_format, self.compress)

    def summarize(self, result: ExtractResult) -> None:
        """Mark complete, with the summary of ``result``."""
        self.complete = True
        self.samples = result.samples
        self.tokens = result.tokens
        self.bytes = result.bytes
        self.skipped = len(result.skipped)
        self.rejected = len(result.rejected)


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        for k, v in value.items()
    }
