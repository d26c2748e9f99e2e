"""NVIDIA ModelOpt >= 0.47's offline Eagle-3 format (``--format modelopt``,
train with ``data.offline_data_path=OUTPUT/hidden_states``).

``OUTPUT/hidden_states/{conversation_id}.pt``, the conversation id being the
input index, one ``torch.save`` dict of tensors and plain types (ModelOpt reads
it with ``weights_only=True``): ``input_ids`` int64 [T], ``hidden_states``
[T, H] (``final_norm``), ``aux_hidden_states`` [T, K*H] (aux layers ascending),
``loss_mask`` int64 [T] (read by ModelOpt only with ``answer_only_loss``),
``conversation_id`` int. Layer ids: `vllm_hs.extract.formats.torch_save`.
"""

from __future__ import annotations

from pathlib import Path

from vllm_hs.extract.formats.torch_save import TorchSaveFiles
from vllm_hs.extract.records import HS_DIR

__all__ = ["ModelOptFiles"]


class ModelOptFiles(TorchSaveFiles):
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
    no_images = (
        "ModelOpt trains VLM drafts online only (its offline path asserts "
        "'Offline data is not supported for VLM.')"
    )

    def path(self, output: Path, row: int, index: int) -> Path:
        return output / HS_DIR / f"{index}.pt"
