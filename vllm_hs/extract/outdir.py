"""The life of one output directory: open it (new, or --resume of a run with the
same settings), and finish it (close gaps, write the dataset, token frequencies,
skip report and, last, the complete manifest). The files are described in
`vllm_hs.extract.format`."""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

from vllm_hs import fs
from vllm_hs.errors import VllmHsError
from vllm_hs.extract.format import (
    COMPACTION,
    HS_DIR,
    MANIFEST,
    ExtractResult,
    Manifest,
    Row,
    Skip,
    read_samples,
    remove_temp_files,
    write_arrow,
    write_skipped,
    write_token_freq,
)
from vllm_hs.extract.inputs import Sample
from vllm_hs.extract.trainers import SampleFiles, sample_files

__all__ = ["finalize", "finish_compaction", "open_output"]


def open_output(output: Path, manifest: Manifest, resume: bool) -> Manifest | None:
    """Create or reopen ``output``; returns the previous manifest on --resume.

    Raises VllmHsError when ``output`` holds something else, or an extraction
    that --resume may not continue (not asked for, or other settings)."""
    path = output / MANIFEST
    if output.exists() and not output.is_dir():
        raise VllmHsError(f"--output {output} exists and is not a directory")
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
        output.mkdir(parents=True, exist_ok=True)
        remove_temp_files(output)
        if previous is None:
            manifest.write(path)
        (output / HS_DIR).mkdir(exist_ok=True)
    return previous


def _files(manifest: Manifest) -> SampleFiles:
    return sample_files(manifest.trainer_format, manifest.compress)


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
    files = _files(manifest)
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
    files = _files(manifest)
    _apply_compaction(output, files)
    record = json.loads((output / COMPACTION).read_text())
    final = [
        Row(array("i", meta.token_ids), bytes(meta.loss_mask))
        for _, meta in read_samples(output, files)
    ]
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
    if files.writes_dataset:
        write_arrow(output, final)
        write_token_freq(output, final)
    result.samples = len(final)
    result.tokens = sum(len(ids) for ids, _ in final)
    result.bytes = sum(path.stat().st_size for path in files.files(output))
    write_skipped(output, result.skipped)
    manifest.summarize(result)
    manifest.write(output / MANIFEST)
    (output / COMPACTION).unlink(missing_ok=True)
