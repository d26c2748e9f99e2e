"""How `vllm-hs extract` stores hidden states: ``--storage-dtype``.

- ``auto``: the model's dtype, as the engine returns the rows.
- ``bfloat16``, ``float16``: rows converted (round to nearest even); a value
  beyond float16's range rejects the sample instead of storing an infinity.
- ``fp8``: speculators' FP8 layout, exactly as hs-connectors'
  ``FP8HiddenStatesConnector`` writes it: ``hidden_states`` float8_e4m3fn
  [T, K, H] and ``hidden_states_scales`` float32 [T, 1, 1], one scale per token
  over all its layers (``max(amax / 448, 1e-12)``); a row is its fp8 values
  times its scale. Read it through hs-connectors' ``FP8Transfer``
  (``ArrowDataset(..., transfer=FP8Transfer(OUTPUT / "hidden_states"))``, or
  ``speculators train --hidden-states-backend fp8``): speculators'
  ``check_hidden_states`` cannot read these files, and its default file reader
  would hand the fp8 values to training without the scales.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FP8",
    "SCALES_KEY",
    "STORAGE_CHOICES",
    "encode_states",
    "reading_note",
    "stored_dtype",
]

STORAGE_CHOICES = ("auto", "bfloat16", "float16", "fp8")
FP8 = "float8_e4m3fn"
#: The per-token scales tensor of the FP8 layout (hs-connectors' SCALES_KEY).
SCALES_KEY = "hidden_states_scales"
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12


def stored_dtype(storage: str, model_dtype: str) -> str:
    """torch dtype name of ``hidden_states`` in the hs files."""
    if storage not in STORAGE_CHOICES:
        raise ValueError(f"storage dtype {storage!r}: one of {STORAGE_CHOICES}")
    if storage == "auto":
        return model_dtype
    return FP8 if storage == "fp8" else storage


def reading_note(dtype: str) -> str | None:
    """What a reader of files with ``hidden_states`` of ``dtype`` must know
    (None: nothing beyond the usual format)."""
    if dtype != FP8:
        return None
    return (
        "hidden_states is float8_e4m3fn with one float32 scale per token in "
        f"{SCALES_KEY} [T, 1, 1] (row = fp8 values * scale): read through "
        "hs_connectors.transfer.FP8Transfer (ArrowDataset(..., transfer="
        "FP8Transfer(OUTPUT / 'hidden_states')), or speculators train "
        "--hidden-states-backend fp8). speculators' check_hidden_states cannot "
        "read these files, and its default reader would skip the scales."
    )


def encode_states(states: Any, dtype: str) -> tuple[dict[str, Any], str | None]:
    """The tensors that store ``states`` [T, K, H] as ``dtype`` (``hidden_states``
    and, for fp8, ``hidden_states_scales``), or ({}, why not) when the values do
    not fit ``dtype``."""
    import torch

    if dtype == FP8:
        values = states.float()
        amax = values.abs().amax(dim=tuple(range(1, values.dim())), keepdim=True)
        scales = (amax / _FP8_MAX).clamp(min=_MIN_SCALE)
        fp8 = (values / scales).to(torch.float8_e4m3fn)
        return {"hidden_states": fp8, SCALES_KEY: scales}, None
    target = getattr(torch, dtype)
    if states.dtype == target:
        return {"hidden_states": states}, None
    converted = states.to(target)
    if dtype == "float16" and not bool(torch.isfinite(converted).all()):
        row, column = (~torch.isfinite(converted)).any(dim=2).nonzero()[0].tolist()
        return {}, (
            f"values beyond float16's range (first at row {row}, column "
            f"{column}); store bfloat16 or the model's dtype instead"
        )
    return {"hidden_states": converted}, None
