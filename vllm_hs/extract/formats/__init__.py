"""The trainer formats of `vllm-hs extract --format`, one module each:
`speculators` (the default: hs files, Arrow dataset, token_freq.pt),
`specforge` and `modelopt` (one ``torch.save`` dict per sample, sharing
`torch_save`); `base.SampleFiles` is what each answers. `sample_files` picks
one by name.
"""

from __future__ import annotations

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.formats.base import SampleFiles
from vllm_hs.extract.formats.modelopt import ModelOptFiles
from vllm_hs.extract.formats.specforge import SpecForgeFiles
from vllm_hs.extract.formats.speculators import SpeculatorsFiles

__all__ = ["FORMATS", "SampleFiles", "sample_files"]

FORMATS = ("speculators", "specforge", "modelopt")


def sample_files(name: str = "speculators", compress: bool = False) -> SampleFiles:
    """The `SampleFiles` of trainer format ``name``."""
    if compress and name != "specforge":
        raise VllmHsError("--compress is for --format specforge (.ckpt.gz files)")
    if name == "speculators":
        return SpeculatorsFiles()
    if name == "specforge":
        return SpecForgeFiles(compress)
    if name == "modelopt":
        return ModelOptFiles()
    raise VllmHsError(f"--format must be one of {', '.join(FORMATS)}, got {name!r}")
