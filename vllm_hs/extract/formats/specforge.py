"""SpecForge >= 0.2's offline Eagle-3 format (``--format specforge``, train with
``--hidden-states-path OUTPUT/hidden_states``).

``OUTPUT/hidden_states/rows_{g}-{g+2000}/data_{row}.ckpt`` (``g`` = the row
rounded down to a multiple of 2000; ``.ckpt.gz`` with --compress), one
``torch.save`` dict: ``input_ids`` int64 [T], ``loss_mask`` int64 [T],
``hidden_state`` [1, T, H] (the last layer: must be ``final_norm``, what the LM
head reads), ``aux_hidden_state`` [1, T, 3*H] (exactly three aux layers,
ascending, concatenated on the hidden dimension), and ``vllm_hs_input_index``
(int64 scalar; SpecForge ignores keys it does not know). Layer ids:
`vllm_hs.extract.formats.torch_save`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_hs.extract.formats.torch_save import TorchSaveFiles
from vllm_hs.extract.records import HS_DIR

__all__ = ["SPECFORGE_GROUP", "SpecForgeFiles"]

SPECFORGE_GROUP = 2000
"""Samples per ``rows_{g}-{g+G}`` directory, as SpecForge's generator groups them."""


class SpecForgeFiles(TorchSaveFiles):
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
    no_images = (
        "SpecForge's offline reader keeps only input_ids, loss_mask and the "
        "states (no image grid for its M-RoPE positions), its VLM training "
        "(--is-vlm) runs the target online on the pixels, and its current "
        "runtime trains no VLM at all"
    )

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
