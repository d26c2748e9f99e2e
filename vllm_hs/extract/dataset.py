"""speculators' dataset files beside the hs files, built from the compact rows:
the Arrow dataset (OUTPUT/data-*.arrow, dataset_info.json, state.json; HF
datasets ``save_to_disk``, torch format: one row per sample, columns input_ids
int64 [T], loss_mask int64 0/1 [T] with 1 on assistant tokens, seq_len int64 =
T; datasets with images also messages, the conversation in OpenAI
content-list form: a list of {role, content: [{type, text, image_url: {url}}]},
what speculators' prepare_data keeps for a multimodal model and sends to the
Chat Completions API when it generates a sample's states online) and
OUTPUT/token_freq.pt (``torch.save`` of {token id: count} over the
loss-masked tokens: what speculators' prepare_data writes and train.py reads,
with --draft-vocab-size, to build the draft vocabulary mapping).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_hs import fs
from vllm_hs.extract.records import TOKEN_FREQ, Row

__all__ = ["write_arrow", "write_token_freq"]

_ARROW_CHUNK_ROWS = 4096


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
    with_messages = any(row.messages is not None for row in rows)
    id_chunks, mask_chunks, message_chunks = [], [], []
    lengths = np.fromiter((len(row.token_ids) for row in rows), np.int64, len(rows))
    for start in range(0, len(rows), _ARROW_CHUNK_ROWS):
        part = rows[start : start + _ARROW_CHUNK_ROWS]
        offsets = np.zeros(len(part) + 1, dtype=np.int64)
        np.cumsum(lengths[start : start + len(part)], out=offsets[1:])
        offsets_array = pa.array(offsets.astype(np.int32))  # < 2**31 per chunk
        ids = np.concatenate([np.frombuffer(row.token_ids, np.int32) for row in part])
        mask = np.concatenate([np.frombuffer(row.loss_mask, np.uint8) for row in part])
        id_chunks.append(
            pa.ListArray.from_arrays(offsets_array, pa.array(ids.astype(np.int64)))
        )
        mask_chunks.append(
            pa.ListArray.from_arrays(offsets_array, pa.array(mask.astype(np.int64)))
        )
        if with_messages:
            message_chunks.append(_messages_array(part))
    columns = {
        "input_ids": pa.chunked_array(id_chunks, type=list_type),
        "loss_mask": pa.chunked_array(mask_chunks, type=list_type),
        "seq_len": pa.array(lengths, type=pa.int64()),
    }
    if with_messages:
        columns["messages"] = pa.chunked_array(message_chunks, type=_messages_type())
    table = pa.table(columns)
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


def _messages_type() -> Any:
    import pyarrow as pa

    part = pa.struct(
        [
            ("type", pa.string()),
            ("text", pa.string()),
            ("image_url", pa.struct([("url", pa.string())])),
        ]
    )
    turn = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    return pa.list_(turn)


def _messages_array(rows: Sequence[Row]) -> Any:
    import pyarrow as pa

    values = []
    for row in rows:
        if row.messages is None:
            raise ValueError("a dataset with images needs every row's messages")
        values.append(json.loads(row.messages))
    return pa.array(values, type=_messages_type())


def write_token_freq(output: Path, rows: Sequence[Row]) -> None:
    """token_freq.pt: {token id: count} over the loss-masked tokens."""
    import io

    import numpy as np
    import torch

    counts: dict[int, int] = {}
    for start in range(0, len(rows), _ARROW_CHUNK_ROWS):
        part = rows[start : start + _ARROW_CHUNK_ROWS]
        ids = np.concatenate([np.frombuffer(row.token_ids, np.int32) for row in part])
        mask = np.concatenate([np.frombuffer(row.loss_mask, np.uint8) for row in part])
        values, numbers = np.unique(ids[mask.astype(bool)], return_counts=True)
        for value, number in zip(values.tolist(), numbers.tolist(), strict=True):
            counts[value] = counts.get(value, 0) + number
    # Saved from memory: torch.save names the zip's root folder after a target
    # file, which would put the random temporary name into the bytes.
    buffer = io.BytesIO()
    torch.save(dict(sorted(counts.items())), buffer)
    fs.atomic_write_bytes(output / TOKEN_FREQ, buffer.getvalue())
