"""The output directory of `vllm-hs extract` as a whole: opening it (new, or
--resume of a run with the same settings), finding the samples a run already
wrote (`scan_finished`), finishing it (close gaps, write the dataset, skip
report and, last, the complete manifest) and merging shard directories
(`merge_shards`).

An output directory OUTPUT holds::

    OUTPUT/hidden_states/...                         (`HS_DIR`)
        one file per sample, in the trainer's format (`vllm_hs.extract.formats`;
        speculators: hs_{row}.safetensors), each naming the input conversation
        it came from.
    OUTPUT/data-*.arrow, dataset_info.json, state.json, token_freq.pt
        speculators only: the Arrow dataset and token counts
        (`vllm_hs.extract.dataset`).
    OUTPUT/vllm_hs_extract.json                      (`MANIFEST`)
        the `vllm_hs.extract.manifest.Manifest`.
    OUTPUT/skipped.jsonl                             (`SKIPPED`)
        one `Skip` per input conversation that was not written: ``{"index": n,
        "reason": "...", "stage": "plan" | "generate" | "validate"}``.
    OUTPUT/.vllm_hs_compaction.json                  (`COMPACTION`)
        only while a finished run renumbers sample files to close gaps (samples
        dropped after planning); a crash there is finished by --resume.

Sharding: shard I of S writes a complete output directory of its own,
`shard_dir` = ``OUTPUT/shard-IIIII-of-SSSSS``; `merge_shards` joins all S into
OUTPUT with rows in input order (the rows and files an unsharded run writes).

Every file is written atomically (`vllm_hs.fs`: a temporary name starting with
``.`` in the same directory, then a rename) with the mode the umask gives a new
file; whatever starts with ``.`` in OUTPUT or below OUTPUT/hidden_states, apart
from `COMPACTION`, is a leftover of an interrupted write and removed by
--resume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from vllm_hs import fs
from vllm_hs.errors import UsageError, VllmHsError
from vllm_hs.extract.formats import SampleFiles
from vllm_hs.extract.images import collapse_image_runs, has_images
from vllm_hs.extract.inputs import Sample
from vllm_hs.extract.manifest import Manifest
from vllm_hs.extract.records import (
    COMPACTION,
    HS_DIR,
    MANIFEST,
    ExtractResult,
    Row,
    SampleMeta,
    Skip,
    read_skipped,
    write_skipped,
)

__all__ = [
    "finalize",
    "finish_compaction",
    "merge_shards",
    "open_output",
    "scan_finished",
    "shard_dir",
]

logger = logging.getLogger(__name__)


def shard_dir(output: Path, shard_index: int, num_shards: int) -> Path:
    """Where shard ``shard_index`` of ``num_shards`` writes its own dataset."""
    return output / f"shard-{shard_index:05d}-of-{num_shards:05d}"


def open_output(output: Path, manifest: Manifest, resume: bool) -> Manifest | None:
    """Create or reopen ``output``; returns the previous manifest on --resume.

    Raises VllmHsError when ``output`` holds something else, or an extraction
    that --resume may not continue (not asked for, or other settings)."""
    path = output / MANIFEST
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output}: exists and is not a directory")
    # A run killed before it wrote its manifest leaves at most these behind:
    # the manifest's temporary file and an empty hidden_states.
    existing = [
        p
        for p in (output.iterdir() if output.is_dir() else ())
        if not p.name.startswith(f".{MANIFEST}.")
        and not (p.name == HS_DIR and p.is_dir() and not any(p.iterdir()))
    ]
    previous = None
    if path.exists():
        previous = Manifest.read(path)
        if not resume:
            raise VllmHsError(
                f"{output} already holds an extraction; pass --resume to continue "
                "or finish it, or choose another --output"
            )
        differ = previous.differences(manifest)
        if differ:
            details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in differ)
            raise VllmHsError(
                f"--resume: {output} was written with other settings ({details}); "
                "use the same model, data and options, or another --output"
            )
    elif existing:
        raise VllmHsError(
            f"--output {output} is not empty and holds no extraction; choose an "
            "empty or new directory"
        )
    if previous is None or not previous.complete:
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--output {output}: {e.strerror or e}") from None
        remove_temp_files(output)
        if previous is None:
            manifest.write(path)
        (output / HS_DIR).mkdir(exist_ok=True)
    return previous


def finalize(
    output: Path,
    samples: Sequence[Sample],
    rows: dict[int, Row],
    manifest: Manifest,
    result: ExtractResult,
) -> None:
    """Remove what writers that died mid-write left, close gaps (samples dropped
    after planning), then write the Arrow dataset, the skip report and the
    manifest (last: it marks the run complete).

    Every writer of the run has finished when this runs; a temporary file left
    now is a dead writer's (a Ray replica killed in the middle of a write, whose
    batch another replica redid)."""
    remove_temp_files(output)
    done = sorted(rows)
    files = manifest.files()
    index_of = {s.row: s.index for s in samples}
    moves = []
    for new, old in enumerate(done):
        index = index_of[old]
        if files.path(output, old, index) != files.path(output, new, index):
            moves.append((old, new, index))
    if moves:
        fs.atomic_write_json(
            output / COMPACTION,
            {
                "moves": [list(move) for move in moves],
                "samples": len(done),
                "skipped": [
                    s.to_json() for s in sorted(result.skipped, key=lambda s: s.index)
                ],
            },
        )
        _apply_compaction(output, files)
    _complete(output, files, [rows[old] for old in done], manifest, result)


def finish_compaction(output: Path, manifest: Manifest, result: ExtractResult) -> None:
    """Finish a run that crashed while closing gaps: all samples were written,
    so finish the renames and build the dataset from the files."""
    files = manifest.files()
    _apply_compaction(output, files)
    record = json.loads((output / COMPACTION).read_text())
    final = [meta.row() for _, meta in read_samples(output, files)]
    if len(final) != record["samples"]:
        raise VllmHsError(
            f"{output}: {len(final)} sample files after closing gaps, expected "
            f"{record['samples']}; rerun without --resume"
        )
    result.skipped = [Skip.from_json(s) for s in record["skipped"]]
    _complete(output, files, final, manifest, result)


def _apply_compaction(output: Path, files: SampleFiles) -> None:
    """Rename sample files down to close gaps; safe to redo after a crash (each
    move is checked against the input index stored in the file)."""
    for old, new, index in json.loads((output / COMPACTION).read_text())["moves"]:
        source = files.path(output, old, index)
        if not source.exists():
            continue  # moved before the crash
        try:
            stored = files.read_meta(source).input_index
        except Exception:  # noqa: BLE001 - a file moved here has another index
            continue
        if stored == index:
            target = files.path(output, new, index)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source, target)


def _complete(
    output: Path,
    files: SampleFiles,
    final: list[Row],
    manifest: Manifest,
    result: ExtractResult,
) -> None:
    files.finish(output, final)
    result.samples = len(final)
    result.tokens = sum(len(row.token_ids) for row in final)
    result.bytes = sum(path.stat().st_size for path in files.files(output))
    write_skipped(output, result.skipped)
    manifest.summarize(result)
    manifest.write(output / MANIFEST)
    (output / COMPACTION).unlink(missing_ok=True)


def scan_finished(
    output: Path,
    samples: Sequence[Sample],
    layers: int,
    hidden: int,
    files: SampleFiles,
    image_token: int | None = None,
) -> dict[int, Row]:
    """Rows whose sample file is complete and belongs to the planned sample
    (--resume); other sample files are deleted, to be redone. ``image_token``:
    the model's (a sample with images holds its expanded prompt)."""
    found: dict[int, Row] = {}
    by_index = {s.index: s for s in samples}
    for path in list(files.files(output)):
        reason: str | None
        try:
            meta = files.read_meta(path)
        except Exception as e:  # noqa: BLE001 - damaged file
            reason = f"unreadable ({type(e).__name__}: {e})"
        else:
            sample = by_index.get(meta.input_index)
            if sample is None:
                reason = f"conversation {meta.input_index} is not in the plan"
            else:
                expected = files.path(output, sample.row, sample.index)
                reason = _mismatch(
                    meta, sample, path == expected, layers, hidden, image_token
                )
                if reason is None:
                    found[sample.row] = meta.row()
                    continue
        logger.info("redoing %s: %s", path.name, reason)
        path.unlink()
    return found


def _mismatch(
    meta: SampleMeta,
    sample: Sample,
    in_place: bool,
    layers: int,
    hidden: int,
    image_token: int | None,
) -> str | None:
    """Why a sample file does not hold the planned ``sample``, or None."""
    token_ids, mask = meta.token_ids, meta.loss_mask
    if image_token is not None and has_images(sample.messages):
        token_ids = collapse_image_runs(token_ids, image_token)
    if not in_place:
        return f"holds conversation {meta.input_index}, which goes to row {sample.row}"
    if meta.shape != (len(meta.token_ids), layers, hidden):
        return f"hidden_states shape {list(meta.shape)}"
    if len(mask) != len(meta.token_ids):
        return "loss mask length"
    if not sample.slots and token_ids != list(sample.input_ids):
        return "token ids differ from the rendered conversation"
    if sample.slots and token_ids[: len(sample.input_ids)] != list(sample.input_ids):
        return "token ids differ from the rendered prompt"
    return None


def read_samples(output: Path, files: SampleFiles) -> list[tuple[Path, SampleMeta]]:
    """Every sample file of a finished directory with what it says, in input
    order (= row order)."""
    found = [(path, files.read_meta(path)) for path in files.files(output)]
    return sorted(found, key=lambda item: item[1].input_index)


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
    files = manifests[0].files()
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
            entries.append((meta.input_index, path, meta.row()))
        skipped += read_skipped(directory)
    entries.sort(key=lambda e: e[0])
    (output / HS_DIR).mkdir(parents=True, exist_ok=True)
    remove_temp_files(output)
    for new, (index, path, _) in enumerate(entries):
        target = files.path(output, new, index)
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.atomic_copy(path, target, link=True)
    rows = [compact for _, _, compact in entries]
    result = ExtractResult(output=output, skipped=skipped)
    merged = dataclasses.replace(
        manifests[0],
        num_shards=1,
        shard_index=0,
        merged_from=[d.name for d in shards],
    )
    _complete(output, files, rows, merged, result)
    logger.info("merged %d shards into %s: %d samples", len(shards), output, len(rows))
    return result
