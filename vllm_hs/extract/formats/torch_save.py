"""What the trainers that read one ``torch.save`` dict per sample share
(`vllm_hs.extract.formats.specforge`, `vllm_hs.extract.formats.modelopt`).

Both name aux layers by the decoder layer whose *output* they are (SGLang's
and HF's ``hidden_states[a + 1]``): trainer aux id ``a`` is vllm-hs layer id
``a + 1``, so their defaults ``[1, L//2 - 1, L - 4]`` are vllm-hs's
``[2, L//2, L - 3]``. The last column must be ``final_norm``, what their LM head
reads. Their readers find samples by suffix (``.ckpt``/``.ckpt.gz``, ``*.pt``)
anywhere below the directory they are given, so nothing else with those
suffixes goes there.
"""

from __future__ import annotations

import gzip
import io
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_hs import fs
from vllm_hs.errors import VllmHsError
from vllm_hs.extract.formats.base import SampleFiles
from vllm_hs.extract.records import HS_DIR, SampleMeta
from vllm_hs.layer_ids import FINAL_NORM, LayerId, default_layers

__all__ = ["TorchSaveFiles"]


class TorchSaveFiles(SampleFiles):
    """Trainers that read one ``torch.save`` dict per sample: the last column
    must be ``final_norm``, the aux columns ascending layer ids. A subclass
    names its files and keys."""

    exact_aux: int | None = None
    file_glob = ""
    """Where its files are, below OUTPUT/hidden_states."""
    file_name = ""
    """The full match of a file name (others, like temporaries, are not samples)."""
    last_key = ""
    aux_key = ""
    index_key = ""
    """The key naming the input conversation."""
    batched = False
    """Whether the states carry a leading batch dimension of 1."""

    def check_layers(self, layers: Sequence[LayerId]) -> None:
        *aux, last = layers
        if last != FINAL_NORM:
            raise VllmHsError(
                f"--format {self.name}: the last of --layers must be final_norm (the "
                f"LM head's input, which {self.name} feeds straight to the LM head), "
                f"got {last!r}"
            )
        if any(not isinstance(k, int) for k in aux) or aux != sorted(set(aux)):
            raise VllmHsError(
                f"--format {self.name}: the aux layers (all of --layers but the "
                f"last) must be distinct layer ids in ascending order, got {aux}"
            )
        if self.exact_aux is not None and len(aux) != self.exact_aux:
            raise VllmHsError(
                f"--format {self.name}: needs exactly {self.exact_aux} aux layers "
                f"before final_norm (its draft model reads {self.exact_aux} x "
                f"hidden_size), got {len(aux)}: {aux}"
            )

    def default_layers(self, num_hidden_layers: int) -> list[LayerId]:
        *aux, _ = default_layers(num_hidden_layers)
        return [*aux, FINAL_NORM]

    def files(self, output: Path) -> Iterator[Path]:
        directory = output / HS_DIR
        if directory.is_dir():
            for path in directory.glob(self.file_glob):
                if re.fullmatch(self.file_name, path.name):
                    yield path

    def index_value(self, index: int) -> Any:
        """How the input index is stored."""
        return index

    def save(
        self,
        path: Path,
        states: dict[str, Any],
        token_ids: Any,
        index: int,
        mask: Sequence[int],
        messages: str | None = None,
    ) -> int:
        import torch

        assert messages is None, f"--format {self.name} takes no images"

        rows = states["hidden_states"]
        count, columns, hidden = rows.shape
        # Tensors of their own: torch.save writes a view's whole storage.
        aux = rows[:, :-1].reshape(count, (columns - 1) * hidden).clone()
        last = rows[:, -1].clone()
        if self.batched:
            aux, last = aux.unsqueeze(0), last.unsqueeze(0)
        record = {
            "input_ids": token_ids,
            "loss_mask": torch.tensor(list(mask), dtype=torch.int64),
            self.last_key: last,
            self.aux_key: aux,
            self.index_key: self.index_value(index),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        with fs.atomic_path(path) as tmp:
            if path.name.endswith(".gz"):
                buffer = io.BytesIO()
                torch.save(record, buffer)
                # mtime 0 and the final name in the header (not the
                # temporary one): the same sample gives the same bytes.
                with (
                    open(tmp, "wb") as raw,
                    gzip.GzipFile(
                        path.name, mode="wb", compresslevel=6, fileobj=raw, mtime=0
                    ) as f,
                ):
                    f.write(buffer.getbuffer())
            else:
                with open(tmp, "wb") as f:
                    torch.save(record, f)
        return path.stat().st_size

    def read_meta(self, path: Path) -> SampleMeta:
        import torch

        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                record = torch.load(io.BytesIO(f.read()), weights_only=True)
        else:
            record = torch.load(path, weights_only=True, mmap=True)
        last, aux = record[self.last_key], record[self.aux_key]
        if self.batched:
            last, aux = last[0], aux[0]
        rows, hidden = last.shape
        return SampleMeta(
            int(record[self.index_key]),
            [int(m) for m in record["loss_mask"].tolist()],
            record["input_ids"].tolist(),
            (rows, aux.shape[1] // hidden + 1, hidden),
        )
