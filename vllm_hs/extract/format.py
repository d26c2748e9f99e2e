"""The output format of `vllm-hs extract`: Eagle-3 training data in the offline
format of speculators >= 0.5, plus vllm-hs's own bookkeeping files.

An output directory OUTPUT holds::

    OUTPUT/data-00000-of-00001.arrow, dataset_info.json, state.json
        HF datasets Arrow dataset (``save_to_disk``, torch format): one row per
        sample; columns input_ids int64 [T], loss_mask int64 0/1 [T] (1 on
        assistant tokens), seq_len int64 (= T). Written by `write_arrow`.
    OUTPUT/hidden_states/hs_{i}.safetensors          (`HS_DIR`, `hs_path`)
        row i of the dataset: tensors hidden_states [T, K, H] (``manifest.dtype``:
        the model's, or --storage-dtype's; column k = layer
        ``manifest.layers[k]``), in the fp8 layout also hidden_states_scales
        float32 [T, 1, 1] (see `vllm_hs.extract.storage`), and token_ids int64 [T]
        (= input_ids of row i); header metadata ``"vllm_hs"`` = JSON
        ``{"input_index": n, "loss_mask": "0011..."}``: the input conversation
        it came from and its loss mask, so --resume and --merge can check and
        rebuild the dataset from the hs files alone. Written by `save_hs_file`.
    OUTPUT/token_freq.pt                             (`TOKEN_FREQ`)
        ``torch.save`` of {token id: count} over the loss-masked tokens: what
        speculators' prepare_data writes and train.py reads (with
        --draft-vocab-size) to build the draft vocabulary mapping.
    OUTPUT/vllm_hs_extract.json                      (`MANIFEST`)
        the `Manifest`: settings, what each column is, summary. Written first
        with ``complete: false``, rewritten last with ``complete: true``.
    OUTPUT/skipped.jsonl                             (`SKIPPED`)
        one `Skip` per input conversation that was not written: ``{"index": n,
        "reason": "...", "stage": "plan" | "generate" | "validate"}``.
    OUTPUT/.vllm_hs_compaction.json                  (`COMPACTION`)
        only while a finished run renumbers hs files to close gaps (samples
        dropped after planning); a crash there is finished by --resume.

That is the default, speculators' format. ``--format specforge`` and
``--format modelopt`` keep the manifest and skipped.jsonl but write their
trainer's per-sample files under OUTPUT/hidden_states instead of hs files, and
no Arrow dataset or token_freq.pt (`vllm_hs.extract.trainers`).

speculators' training reads OUTPUT as is (``ArrowDataset(datapath=OUTPUT)``,
``train.py --data-path OUTPUT``): ``hs[:, :-1]`` are the aux layers, ``hs[:, -1]``
the verifier's last hidden state, so the last layer id should be L (the last
decoder layer's output before the final norm).

Sharding: shard I of S writes a complete output directory of its own,
`shard_dir` = ``OUTPUT/shard-IIIII-of-SSSSS``; `merge_shards` joins all S into
OUTPUT with rows in input order (the rows and hs files an unsharded run writes).

Every file is written atomically (`vllm_hs.fs`: a temporary name starting with
``.`` in the same directory, then a rename) with the mode the umask gives a new
file; whatever starts with ``.`` in OUTPUT or OUTPUT/hidden_states, apart from
`COMPACTION`, is a leftover of an interrupted write and removed by --resume.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import shutil
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_hs import fs
from vllm_hs.errors import VllmHsError
from vllm_hs.extract.safetensors_file import write_safetensors

if TYPE_CHECKING:
    from vllm_hs.extract.inputs import Sample
    from vllm_hs.extract.trainers import SampleFiles

__all__ = [
    "COMPACTION",
    "FINGERPRINT_KEYS",
    "FORMAT_VERSION",
    "HS_DIR",
    "MANIFEST",
    "SKIPPED",
    "TOKEN_FREQ",
    "ExtractResult",
    "HsFileMeta",
    "Manifest",
    "RegenerateSettings",
    "Row",
    "Skip",
    "SkipStage",
    "hs_path",
    "merge_shards",
    "read_hs_meta",
    "save_hs_file",
    "shard_dir",
    "write_arrow",
    "write_token_freq",
]

logger = logging.getLogger(__name__)

HS_DIR = "hidden_states"
MANIFEST = "vllm_hs_extract.json"
SKIPPED = "skipped.jsonl"
TOKEN_FREQ = "token_freq.pt"
COMPACTION = ".vllm_hs_compaction.json"
#: Bumped when a reader of an older output would misread a newer one.
FORMAT_VERSION = 1
FORMAT_DESCRIPTION = (
    "speculators>=0.5 offline: Arrow dataset (input_ids, loss_mask, seq_len) + "
    "hidden_states/hs_{i}.safetensors (hidden_states, token_ids)"
)

#: The one metadata key of an hs file (one key, so that readers that keep
#: safetensors metadata in a hash map cannot reorder it).
_METADATA_KEY = "vllm_hs"
_ARROW_CHUNK_ROWS = 4096


def hs_path(output: Path, row: int) -> Path:
    """The hs file of dataset row ``row``."""
    return output / HS_DIR / f"hs_{row}.safetensors"


def shard_dir(output: Path, shard_index: int, num_shards: int) -> Path:
    """Where shard ``shard_index`` of ``num_shards`` writes its own dataset."""
    return output / f"shard-{shard_index:05d}-of-{num_shards:05d}"


class Row(NamedTuple):
    """One dataset row in compact form (plans of millions of samples stay small)."""

    token_ids: array
    """``array('i')``: 4 bytes a token."""
    loss_mask: bytes
    """0/1 per token; as long as ``token_ids``."""


# ----------------------------------------------------------------------------
# skipped.jsonl
# ----------------------------------------------------------------------------


class SkipStage(str, enum.Enum):
    """Where a conversation was dropped (the ``stage`` of skipped.jsonl)."""

    PLAN = "plan"
    """Before any engine work: too long, no assistant tokens, template failure."""
    GENERATE = "generate"
    """--regenerate, between turns: a later turn's prompt could not be built."""
    VALIDATE = "validate"
    """The engine's result failed a check; the run exits non-zero."""


@dataclasses.dataclass
class Skip:
    """An input conversation that was not written, and why (a skipped.jsonl row)."""

    index: int
    """Position of the conversation in the input (all shards together)."""
    reason: str
    stage: SkipStage = SkipStage.PLAN

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "reason": self.reason, "stage": self.stage.value}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Skip:
        return cls(int(value["index"]), str(value["reason"]), SkipStage(value["stage"]))


def write_skipped(output: Path, skipped: Iterable[Skip]) -> None:
    """skipped.jsonl, in input order."""
    rows = sorted(skipped, key=lambda s: s.index)
    fs.atomic_write_text(
        output / SKIPPED, "".join(json.dumps(s.to_json()) + "\n" for s in rows)
    )


def read_skipped(output: Path) -> list[Skip]:
    path = output / SKIPPED
    if not path.exists():
        return []
    return [Skip.from_json(json.loads(x)) for x in path.read_text().splitlines() if x]


# ----------------------------------------------------------------------------
# The manifest
# ----------------------------------------------------------------------------

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
class RegenerateSettings:
    """The --regenerate options (``manifest.regenerate``; null without it)."""

    max_new_tokens: int
    temperature: float
    seed: int
    """Conversation n samples with seed ``seed + n`` when temperature > 0."""


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
    """Layer id of each hidden_states column, in column order (see layers.py)."""
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
    format: str = FORMAT_DESCRIPTION
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
    """--format: the trainer whose files these are (`vllm_hs.extract.trainers`)."""
    compress: bool = False
    """--compress (specforge: gzipped .ckpt.gz files)."""

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

    def summarize(self, result: ExtractResult) -> None:
        """Mark complete, with the summary of ``result``."""
        self.complete = True
        self.samples = result.samples
        self.tokens = result.tokens
        self.bytes = result.bytes
        self.skipped = len(result.skipped)
        self.rejected = len(result.rejected)


@dataclasses.dataclass
class ExtractResult:
    """What an extraction or merge produced (the summary the CLI prints)."""

    output: Path
    samples: int = 0
    """Rows of the finished dataset."""
    tokens: int = 0
    bytes: int = 0
    written: int = 0
    """hs files written by this call (the rest were found by --resume)."""
    written_tokens: int = 0
    seconds: float = 0.0
    """Wall time of the extraction loop (engine work and writes)."""
    skipped: list[Skip] = dataclasses.field(default_factory=list)
    layers: list[int | str] = dataclasses.field(default_factory=list)
    already_complete: bool = False

    @property
    def rejected(self) -> list[Skip]:
        return [s for s in self.skipped if s.stage is SkipStage.VALIDATE]


# ----------------------------------------------------------------------------
# hs files
# ----------------------------------------------------------------------------


class HsFileMeta(NamedTuple):
    """What an hs file says about itself."""

    input_index: int
    loss_mask: list[int]
    token_ids: list[int]
    shape: tuple[int, ...]
    """Shape of hidden_states: (T, K, H)."""


def save_hs_file(
    path: Path,
    states: dict[str, Any],
    token_ids: Any,
    index: int,
    mask: Sequence[int],
) -> int:
    """Write one hs file atomically; returns its size.

    ``states``: ``hidden_states`` [T, K, H] and, in the fp8 layout, its
    ``hidden_states_scales`` (`vllm_hs.extract.storage.encode_states`);
    ``token_ids`` int64 [T]; all torch tensors."""
    meta = {"input_index": index, "loss_mask": "".join("1" if m else "0" for m in mask)}
    with fs.atomic_path(path) as tmp:
        write_safetensors(
            tmp,
            {**states, "token_ids": token_ids},
            metadata={_METADATA_KEY: json.dumps(meta, sort_keys=True)},
        )
    return path.stat().st_size


def read_hs_meta(path: Path) -> HsFileMeta:
    """The metadata, token ids and states shape of an hs file (the states are not
    read); raises on a damaged file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})[_METADATA_KEY])
        token_ids = f.get_tensor("token_ids").tolist()
        shape = tuple(f.get_slice("hidden_states").get_shape())
    mask = [1 if c == "1" else 0 for c in meta["loss_mask"]]
    return HsFileMeta(int(meta["input_index"]), mask, token_ids, shape)


def scan_finished(
    output: Path,
    samples: Sequence[Sample],
    layers: int,
    hidden: int,
    files: SampleFiles,
) -> dict[int, Row]:
    """Rows whose sample file is complete and belongs to the planned sample
    (--resume); other sample files are deleted, to be redone."""
    found: dict[int, Row] = {}
    by_index = {s.index: s for s in samples}
    for path in list(files.files(output)):
        reason = None
        try:
            index, mask, token_ids, shape = files.read_meta(path)
        except Exception as e:  # noqa: BLE001 - damaged file
            reason = f"unreadable ({type(e).__name__}: {e})"
        else:
            sample = by_index.get(index)
            if sample is None:
                reason = f"conversation {index} is not in the plan"
            elif files.path(output, sample.row, sample.index) != path:
                reason = f"holds conversation {index}, which goes to row {sample.row}"
            elif shape != (len(token_ids), layers, hidden):
                reason = f"hidden_states shape {list(shape)}"
            elif len(mask) != len(token_ids):
                reason = "loss mask length"
            elif not sample.slots and token_ids != list(sample.input_ids):
                reason = "token ids differ from the rendered conversation"
            elif sample.slots and token_ids[: len(sample.input_ids)] != list(
                sample.input_ids
            ):
                reason = "token ids differ from the rendered prompt"
        if reason is None:
            found[sample.row] = Row(array("i", token_ids), bytes(mask))
        else:
            logger.info("redoing %s: %s", path.name, reason)
            path.unlink()
    return found


def read_samples(output: Path, files: SampleFiles) -> list[tuple[Path, HsFileMeta]]:
    """Every sample file of a finished directory with what it says, in input
    order (= row order)."""
    found = [(path, files.read_meta(path)) for path in files.files(output)]
    return sorted(found, key=lambda item: item[1].input_index)


# ----------------------------------------------------------------------------
# The Arrow dataset and token frequencies
# ----------------------------------------------------------------------------


def write_arrow(output: Path, rows: Sequence[Row]) -> None:
    """The Arrow dataset (speculators' columns, int64, torch format), built from
    the compact rows in chunks, saved into a staging directory in ``output`` and
    moved into ``output`` file by file, state.json last."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset
    from datasets.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    list_type = pa.list_(pa.int64())
    id_chunks, mask_chunks = [], []
    lengths = np.fromiter((len(ids) for ids, _ in rows), np.int64, len(rows))
    for start in range(0, len(rows), _ARROW_CHUNK_ROWS):
        part = rows[start : start + _ARROW_CHUNK_ROWS]
        offsets = np.zeros(len(part) + 1, dtype=np.int64)
        np.cumsum(lengths[start : start + len(part)], out=offsets[1:])
        offsets_array = pa.array(offsets.astype(np.int32))  # < 2**31 per chunk
        ids = np.concatenate([np.frombuffer(ids, np.int32) for ids, _ in part])
        mask = np.concatenate([np.frombuffer(m, np.uint8) for _, m in part])
        id_chunks.append(
            pa.ListArray.from_arrays(offsets_array, pa.array(ids.astype(np.int64)))
        )
        mask_chunks.append(
            pa.ListArray.from_arrays(offsets_array, pa.array(mask.astype(np.int64)))
        )
    table = pa.table(
        {
            "input_ids": pa.chunked_array(id_chunks, type=list_type),
            "loss_mask": pa.chunked_array(mask_chunks, type=list_type),
            "seq_len": pa.array(lengths, type=pa.int64()),
        }
    )
    dataset = Dataset(table)
    dataset.set_format(type="torch")
    with fs.staging_dir(output, "arrow") as tmp:
        bars_were_on = not are_progress_bars_disabled()
        disable_progress_bars()
        try:
            dataset.save_to_disk(str(tmp))
        finally:
            if bars_were_on:
                enable_progress_bars()
        for old in output.glob("data-*.arrow"):
            old.unlink()
        names = sorted(p.name for p in tmp.iterdir())
        for name in sorted(names, key=lambda n: n == "state.json"):
            os.replace(tmp / name, output / name)


def write_token_freq(output: Path, rows: Sequence[Row]) -> None:
    """token_freq.pt: {token id: count} over the loss-masked tokens."""
    import io

    import numpy as np
    import torch

    counts: dict[int, int] = {}
    for start in range(0, len(rows), _ARROW_CHUNK_ROWS):
        part = rows[start : start + _ARROW_CHUNK_ROWS]
        ids = np.concatenate([np.frombuffer(ids, np.int32) for ids, _ in part])
        mask = np.concatenate([np.frombuffer(m, np.uint8) for _, m in part])
        values, numbers = np.unique(ids[mask.astype(bool)], return_counts=True)
        for value, number in zip(values.tolist(), numbers.tolist(), strict=True):
            counts[value] = counts.get(value, 0) + number
    # Saved from memory: torch.save names the zip's root folder after a target
    # file, which would put the random temporary name into the bytes.
    buffer = io.BytesIO()
    torch.save(dict(sorted(counts.items())), buffer)
    fs.atomic_write_bytes(output / TOKEN_FREQ, buffer.getvalue())


# ----------------------------------------------------------------------------
# Leftovers of interrupted writes
# ----------------------------------------------------------------------------


def remove_temp_files(output: Path) -> None:
    """Delete what an interrupted run leaves: files starting with ``.`` in
    ``output`` and its hidden_states (our atomic writes' temporary names, and
    the ``.tmpXXXXXX`` files of runs that wrote through safetensors' own writer)
    other than the compaction journal, and ``.tmp-*`` staging directories."""
    groups = []  # subdirectories of sample files (specforge's rows_*)
    if (output / HS_DIR).is_dir():
        groups = [
            p
            for p in (output / HS_DIR).iterdir()
            if p.is_dir() and not p.name.startswith(".")
        ]
    for directory in (output, output / HS_DIR, *groups):
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if not path.name.startswith(".") or path.name == COMPACTION:
                continue
            if path.is_file():
                path.unlink()
            elif path.is_dir() and path.name.startswith(".tmp-"):
                shutil.rmtree(path)


# ----------------------------------------------------------------------------
# Merging shards
# ----------------------------------------------------------------------------


def merge_shards(output: Path | str) -> ExtractResult:
    """Merge ``output/shard-*-of-S`` (all S complete, same settings) into one
    dataset in ``output``, rows in input order: the same rows and hs files an
    unsharded run writes. hs files are hard-linked (copied across file
    systems)."""
    output = Path(output)
    shards = sorted(output.glob("shard-*-of-*"))
    if not shards:
        raise VllmHsError(f"--merge: no shard-*-of-* directories in {output}")
    manifests = []
    for directory in shards:
        path = directory / MANIFEST
        if not path.exists():
            raise VllmHsError(f"--merge: {directory} holds no extraction")
        manifest = Manifest.read(path)
        if not manifest.complete:
            raise VllmHsError(
                f"--merge: {directory} is not complete; finish it with --resume"
            )
        manifests.append(manifest)
    num_shards = manifests[0].num_shards
    got = sorted(m.shard_index for m in manifests)
    if got != list(range(num_shards)) or any(
        m.num_shards != num_shards for m in manifests
    ):
        raise VllmHsError(
            f"--merge: need shards 0..{num_shards - 1} of {num_shards}, found "
            f"{[d.name for d in shards]}"
        )
    for manifest, directory in zip(manifests, shards, strict=True):
        differ = [k for k, _, _ in manifest.differences(manifests[0])]
        if differ:
            raise VllmHsError(
                f"--merge: {directory.name} was made with other settings: {differ}"
            )
    if (output / MANIFEST).exists():
        raise VllmHsError(f"--merge: {output} already holds a dataset")
    from vllm_hs.extract.trainers import sample_files

    files = sample_files(manifests[0].trainer_format, manifests[0].compress)
    entries = []  # (input index, file, Row)
    skipped: list[Skip] = []
    for directory, manifest in zip(shards, manifests, strict=True):
        found = read_samples(directory, files)
        if len(found) != (manifest.samples or 0):
            raise VllmHsError(
                f"--merge: {directory.name} holds {len(found)} sample files, its "
                f"manifest says {manifest.samples}"
            )
        for path, meta in found:
            compact = Row(array("i", meta.token_ids), bytes(meta.loss_mask))
            entries.append((meta.input_index, path, compact))
        skipped += read_skipped(directory)
    entries.sort(key=lambda e: e[0])
    (output / HS_DIR).mkdir(parents=True, exist_ok=True)
    remove_temp_files(output)
    sizes = 0
    for new, (index, path, _) in enumerate(entries):
        target = files.path(output, new, index)
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.atomic_copy(path, target, link=True)
        sizes += target.stat().st_size
    rows = [compact for _, _, compact in entries]
    if files.writes_dataset:
        write_arrow(output, rows)
        write_token_freq(output, rows)
    result = ExtractResult(output=output, layers=manifests[0].layers, skipped=skipped)
    result.samples = len(rows)
    result.tokens = sum(len(r.token_ids) for r in rows)
    result.bytes = sizes
    write_skipped(output, skipped)
    merged = dataclasses.replace(
        manifests[0],
        num_shards=1,
        shard_index=0,
        merged_from=[d.name for d in shards],
    )
    merged.summarize(result)
    merged.write(output / MANIFEST)
    logger.info("merged %d shards into %s: %d samples", len(shards), output, len(rows))
    return result
