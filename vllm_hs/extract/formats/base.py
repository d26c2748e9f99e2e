"""What every trainer format of `vllm-hs extract --format` answers: where a
sample's file goes, how it is written and read back, which columns the trainer
can use, and what else the finished directory holds (`SampleFiles`).

Every format keeps one file per sample under ``OUTPUT/hidden_states/``, and
each file names the input conversation it came from, so --resume, --merge and
the final gap-closing (`vllm_hs.extract.outdir`) work the same way for all.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.records import Row, SampleMeta
from vllm_hs.layer_ids import LayerId, default_layers

__all__ = ["SampleFiles"]


class SampleFiles(abc.ABC):
    """Where one trainer keeps a sample and how it is written and read back."""

    name: str
    """--format."""
    description: str
    """What the files are (the manifest's ``format``)."""
    stores_fp8 = False
    """Whether the trainer can read speculators' fp8 layout (scales)."""
    no_images: str | None = "its trainer reads no image data"
    """Why the trainer cannot take samples with images; None when it can."""

    @abc.abstractmethod
    def path(self, output: Path, row: int, index: int) -> Path:
        """The file of dataset row ``row`` (input conversation ``index``)."""

    @abc.abstractmethod
    def files(self, output: Path) -> Iterator[Path]:
        """Every sample file in ``output`` (also those of an interrupted run)."""

    @abc.abstractmethod
    def save(
        self,
        path: Path,
        states: dict[str, Any],
        token_ids: Any,
        index: int,
        mask: Sequence[int],
        messages: str | None = None,
    ) -> int:
        """Write one sample atomically; returns its size. ``states``:
        ``hidden_states`` [T, K, H] (and, fp8, its scales); ``messages``:
        `vllm_hs.extract.records.Row.messages` (only formats that take images
        get one)."""

    @abc.abstractmethod
    def read_meta(self, path: Path) -> SampleMeta:
        """What a sample file says about itself; raises on a damaged file."""

    def check_layers(self, layers: Sequence[LayerId]) -> None:
        """Raise VllmHsError if the trainer cannot use these columns (the
        default: any columns)."""
        return None

    def check_images(self) -> None:
        """Raise VllmHsError if the trainer cannot take samples with images
        (called before any model loads)."""
        if self.no_images is not None:
            raise VllmHsError(
                f"--data holds images, which --format {self.name} cannot carry: "
                f"{self.no_images}; use --format speculators"
            )

    def default_layers(self, num_hidden_layers: int) -> list[LayerId]:
        return list(default_layers(num_hidden_layers))

    def finish(self, output: Path, rows: Sequence[Row]) -> None:
        """Write what the finished directory holds besides the sample files
        (``rows``: the dataset rows in order; the default: nothing)."""
        return None
