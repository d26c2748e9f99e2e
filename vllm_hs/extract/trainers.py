"""The per-sample files of each trainer `vllm-hs extract --format` writes.

Every format keeps one file per sample under ``OUTPUT/hidden_states/``, and
each file names the input conversation it came from, so --resume, --merge and
the final gap-closing work the same way for all of them:

- ``speculators`` (default): ``hs_{row}.safetensors`` (`vllm_hs.extract.format`),
  plus the Arrow dataset and token_freq.pt in OUTPUT.
- ``specforge`` (SpecForge >= 0.2 offline Eagle-3, ``--hidden-states-path
  OUTPUT/hidden_states``): ``rows_{g}-{g+2000}/data_{row}.ckpt`` (``g`` = the
  row rounded down to a multiple of 2000; ``.ckpt.gz`` with --compress), one
  ``torch.save`` dict: ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
  ``hidden_state`` [1, T, H] (the last layer: must be ``final_norm``, what the LM
  head reads), ``aux_hidden_state`` [1, T, 3*H] (exactly three aux layers,
  ascending, concatenated on the hidden dimension), and ``vllm_hs_input_index``
  (int64 scalar; SpecForge ignores keys it does not know).
- ``modelopt`` (NVIDIA ModelOpt >= 0.47 offline Eagle-3, ``data.offline_data_path
  OUTPUT/hidden_states``): ``{conversation_id}.pt``, the conversation id being
  the input index, one ``torch.save`` dict of tensors and plain types (ModelOpt
  reads it with ``weights_only=True``): ``input_ids`` int64 [T], ``hidden_states``
  [T, H] (``final_norm``), ``aux_hidden_states`` [T, K*H] (aux layers ascending),
  ``loss_mask`` int64 [T] (read by ModelOpt only with ``answer_only_loss``),
  ``conversation_id`` int.

Both trainers name aux layers by the decoder layer whose *output* they are
(SGLang's and HF's ``hidden_states[a + 1]``): trainer aux id ``a`` is vllm-hs
layer id ``a + 1``, so their defaults ``[1, L//2 - 1, L - 4]`` are vllm-hs's
``[2, L//2, L - 3]``. Their readers find samples by suffix (``.ckpt``/``.ckpt.gz``,
``*.pt``) anywhere below the directory they are given, so nothing else with
those suffixes goes there.
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
from vllm_hs.extract.format import (
    HS_DIR,
    HsFileMeta,
    hs_path,
    read_hs_meta,
    save_hs_file,
)
from vllm_hs.layer_ids import FINAL_NORM

__all__ = ["FORMATS", "SampleFiles", "sample_files"]

SPECFORGE_GROUP = 2000
"""Samples per ``rows_{g}-{g+G}`` directory, as SpecForge's generator groups them."""


class SampleFiles:
    """Where one trainer keeps a sample and how it is written and read back."""

    name = "speculators"
    description = (
        "speculators>=0.5 offline: Arrow dataset (input_ids, loss_mask, seq_len) + "
        "hidden_states/hs_{i}.safetensors (hidden_states, token_ids)"
    )
    writes_dataset = True
    """Whether OUTPUT also gets the Arrow dataset and token_freq.pt."""
    stores_fp8 = True
    """Whether the trainer can read speculators' fp8 layout (scales)."""

    def path(self, output: Path, row: int, index: int) -> Path:
        """The file of dataset row ``row`` (input conversation ``index``)."""
        return hs_path(output, row)

    def files(self, output: Path) -> Iterator[Path]:
        """Every sample file in ``output`` (also those of an interrupted run)."""
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
    ) -> int:
        """Write one sample atomically; returns its size. ``states``:
        ``hidden_states`` [T, K, H] (and, fp8, its scales)."""
        return save_hs_file(path, states, token_ids, index, mask)

    def read_meta(self, path: Path) -> HsFileMeta:
        """What a sample file says about itself; raises on a damaged file."""
        return read_hs_meta(path)

    def check_layers(self, layers: Sequence[int | str], num_hidden_layers: int) -> None:
        """Raise VllmHsError if the trainer cannot use these columns."""

    def default_layers(self, num_hidden_layers: int) -> list[int | str]:
        from vllm_hs.layer_ids import default_layers

        return list(default_layers(num_hidden_layers))


class _TorchSaveFiles(SampleFiles):
    """Trainers that read one ``torch.save`` dict per sample: the last column
    must be ``final_norm``, the aux columns ascending layer ids. A subclass
    names its files and keys."""

    stores_fp8 = False
    writes_dataset = False
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

    def check_layers(self, layers: Sequence[int | str], num_hidden_layers: int) -> None:
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

    def default_layers(self, num_hidden_layers: int) -> list[int | str]:
        from vllm_hs.layer_ids import default_layers

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
    ) -> int:
        import torch

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
                # mtime 0: the same sample gives the same bytes.
                with (
                    open(tmp, "wb") as raw,
                    gzip.GzipFile(
                        fileobj=raw, mode="wb", compresslevel=6, mtime=0
                    ) as f,
                ):
                    f.write(buffer.getbuffer())
            else:
                with open(tmp, "wb") as f:
                    torch.save(record, f)
        return path.stat().st_size

    def read_meta(self, path: Path) -> HsFileMeta:
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
        return HsFileMeta(
            int(record[self.index_key]),
            [int(m) for m in record["loss_mask"].tolist()],
            record["input_ids"].tolist(),
            (rows, aux.shape[1] // hidden + 1, hidden),
        )


class SpecForgeFiles(_TorchSaveFiles):
    name = "specforge"
    description = (
        "SpecForge>=0.2 offline Eagle-3: hidden_states/rows_{g}-{g+2000}/"
        "data_{i}.ckpt[.gz] (torch.save: input_ids, loss_mask, hidden_state "
        "[1, T, H] final norm, aux_hidden_state [1, T, 3H])"
    )
    exact_aux = 3
    file_glob = "rows_*/data_*.ckpt*"
    file_name = r"data_\d+\.ckpt(\.gz)?"
    last_key = "hidden_state"
    aux_key = "aux_hidden_state"
    index_key = "vllm_hs_input_index"
    batched = True

    def __init__(self, compress: bool = False) -> None:
        self.suffix = ".ckpt.gz" if compress else ".ckpt"

    def path(self, output: Path, row: int, index: int) -> Path:
        group = row // SPECFORGE_GROUP * SPECFORGE_GROUP
        return (
            output
            / HS_DIR
            / f"rows_{group}-{group + SPECFORGE_GROUP}"
            / f"data_{row}{self.suffix}"
        )

    def index_value(self, index: int) -> Any:
        import torch

        # SpecForge's generator stores only tensors; its reader ignores the key.
        return torch.tensor(index, dtype=torch.int64)


class ModelOptFiles(_TorchSaveFiles):
    name = "modelopt"
    description = (
        "ModelOpt>=0.47 offline Eagle-3: hidden_states/{conversation_id}.pt "
        "(torch.save: input_ids, hidden_states [T, H] final norm, "
        "aux_hidden_states [T, K*H], loss_mask, conversation_id)"
    )
    file_glob = "*.pt"
    file_name = r"\d+\.pt"
    last_key = "hidden_states"
    aux_key = "aux_hidden_states"
    index_key = "conversation_id"

    def path(self, output: Path, row: int, index: int) -> Path:
        return output / HS_DIR / f"{index}.pt"


FORMATS = ("speculators", "specforge", "modelopt")


def sample_files(name: str = "speculators", compress: bool = False) -> SampleFiles:
    """The `SampleFiles` of trainer format ``name``."""
    if compress and name != "specforge":
        raise VllmHsError("--compress is for --format specforge (.ckpt.gz files)")
    if name == "speculators":
        return SampleFiles()
    if name == "specforge":
        return SpecForgeFiles(compress)
    if name == "modelopt":
        return ModelOptFiles()
    raise VllmHsError(f"--format must be one of {', '.join(FORMATS)}, got {name!r}")
