"""speculators >= 0.5's offline format (the default ``--format``): one
``OUTPUT/hidden_states/hs_{row}.safetensors`` per dataset row, the Arrow
dataset and token_freq.pt (`vllm_hs.extract.dataset`).

An hs file holds ``hidden_states`` [T, K, H] (the model's dtype or
--storage-dtype's; column k = layer ``manifest.layers[k]``), in the fp8 layout
also ``hidden_states_scales`` float32 [T, 1, 1] (`vllm_hs.extract.storage`), and
``token_ids`` int64 [T] (= input_ids of row i); its header metadata ``"vllm_hs"``
= JSON ``{"input_index": n, "loss_mask": "0011..."}``: the input conversation it
came from and its loss mask (datasets with images also ``"messages"``, the
``messages`` column's value), so --resume and --merge can check and rebuild the
dataset from the hs files alone.

Images (speculators >= 0.9's VLM data): ``token_ids``/``input_ids`` are the
engine's expanded prompt (one image token per visual token), the states cover
every position, and the Arrow dataset gains a ``messages`` column.

speculators' training reads OUTPUT as is (``ArrowDataset(datapath=OUTPUT)``,
``train.py --data-path OUTPUT``): ``hs[:, :-1]`` are the aux layers,
``hs[:, -1]`` the verifier's last hidden state, so the last layer id should be
L (the last decoder layer's output before the final norm).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_hs import fs
from vllm_hs.extract.dataset import write_arrow, write_token_freq
from vllm_hs.extract.formats.base import SampleFiles
from vllm_hs.extract.records import HS_DIR, Row, SampleMeta
from vllm_hs.extract.safetensors_file import write_safetensors

__all__ = ["SpeculatorsFiles", "hs_path", "save_hs_file"]

#: The one metadata key of an hs file (one key, so that readers that keep
#: safetensors metadata in a hash map cannot reorder it).
_METADATA_KEY = "vllm_hs"


def hs_path(output: Path, row: int) -> Path:
    """The hs file of dataset row ``row``."""
    return output / HS_DIR / f"hs_{row}.safetensors"


class SpeculatorsFiles(SampleFiles):
    name = "speculators"
    description = (
        "speculators>=0.5 offline: Arrow dataset (input_ids, loss_mask, seq_len) + "
        "hidden_states/hs_{i}.safetensors (hidden_states, token_ids)"
    )
    stores_fp8 = True
    no_images = None

    def path(self, output: Path, row: int, index: int) -> Path:
        return hs_path(output, row)

    def files(self, output: Path) -> Iterator[Path]:
        directory = output / HS_DIR
        if directory.is_dir():
            yield from directory.glob("hs_*.safetensors")

    def save(
        self,
        path: Path,
        states: dict[str, Any],
        token_ids: Any,
        index: int,
        mask: Sequence[int],
        messages: str | None = None,
    ) -> int:
        """Write one hs file atomically; returns its size.

        ``states``: ``hidden_states`` [T, K, H] and, in the fp8 layout, its
        ``hidden_states_scales`` (`vllm_hs.extract.storage.encode_states`);
        ``token_ids`` int64 [T]; all torch tensors."""
        meta: dict[str, Any] = {
            "input_index": index,
            "loss_mask": "".join("1" if m else "0" for m in mask),
        }
        if messages is not None:
            meta["messages"] = json.loads(messages)
        with fs.atomic_path(path) as tmp:
            write_safetensors(
                tmp,
                {**states, "token_ids": token_ids},
                metadata={_METADATA_KEY: json.dumps(meta, sort_keys=True)},
            )
        return path.stat().st_size

    def read_meta(self, path: Path) -> SampleMeta:
        """The metadata, token ids and states shape of an hs file (the states
        are not read); raises on a damaged file."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_METADATA_KEY])
            token_ids = f.get_tensor("token_ids").tolist()
            shape = tuple(f.get_slice("hidden_states").get_shape())
        mask = [1 if c == "1" else 0 for c in meta["loss_mask"]]
        messages = meta.get("messages")
        return SampleMeta(
            int(meta["input_index"]),
            mask,
            token_ids,
            shape,
            None if messages is None else json.dumps(messages, sort_keys=True),
        )

    def finish(self, output: Path, rows: Sequence[Row]) -> None:
        """The Arrow dataset and token_freq.pt."""
        write_arrow(output, rows)
        write_token_freq(output, rows)


#: Write one hs file (for writers of hs files outside a run: tests, benchmarks).
save_hs_file = SpeculatorsFiles().save
