"""The records of an output directory, in memory and as files: the file names,
a dataset `Row`, a `Skip` (skipped.jsonl), what a sample file says about itself
(`SampleMeta`) and the summary of a run (`ExtractResult`). The manifest is
`vllm_hs.extract.manifest`; the directory as a whole, `vllm_hs.extract.outdir`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from vllm_hs import fs

__all__ = [
    "COMPACTION",
    "HS_DIR",
    "MANIFEST",
    "SKIPPED",
    "TOKEN_FREQ",
    "ExtractResult",
    "Row",
    "SampleMeta",
    "Skip",
    "SkipStage",
    "read_skipped",
    "write_skipped",
]

HS_DIR = "hidden_states"
MANIFEST = "vllm_hs_extract.json"
SKIPPED = "skipped.jsonl"
TOKEN_FREQ = "token_freq.pt"
COMPACTION = ".vllm_hs_compaction.json"


class Row(NamedTuple):
    """One dataset row in compact form (plans of millions of samples stay small)."""

    token_ids: array
    """``array('i')``: 4 bytes a token."""
    loss_mask: bytes
    """0/1 per token; as long as ``token_ids``."""
    messages: str | None = None
    """Datasets with images: the sample's conversation, JSON in OpenAI
    content-list form (`vllm_hs.extract.images.messages_json`); else None."""


class SampleMeta(NamedTuple):
    """What a sample file says about itself (every trainer format)."""

    input_index: int
    loss_mask: list[int]
    token_ids: list[int]
    shape: tuple[int, ...]
    """Shape of hidden_states: (T, K, H)."""
    messages: str | None = None
    """`Row.messages`."""

    def row(self) -> Row:
        return Row(array("i", self.token_ids), bytes(self.loss_mask), self.messages)


# ----------------------------------------------------------------------------
# skipped.jsonl
# ----------------------------------------------------------------------------


class SkipStage(str, enum.Enum):
    """Where a conversation was dropped (the ``stage`` of skipped.jsonl)."""

    PLAN = "plan"
    """Before any engine work: too long, no assistant tokens, template failure;
    also a sample with images that is too long once the engine expanded them."""
    GENERATE = "generate"
    """--regenerate, between turns: a later turn's prompt could not be built."""
    VALIDATE = "validate"
    """The engine's result failed a check; the run exits non-zero."""


@dataclasses.dataclass
class Skip:
    """An input conversation that was not written, and why (a skipped.jsonl row)."""

    index: int
    """Position of the conversation in the input (all shards together)."""
    reason: str
    stage: SkipStage = SkipStage.PLAN

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "reason": self.reason, "stage": self.stage.value}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Skip:
        return cls(int(value["index"]), str(value["reason"]), SkipStage(value["stage"]))


def write_skipped(output: Path, skipped: Iterable[Skip]) -> None:
    """skipped.jsonl, in input order."""
    rows = sorted(skipped, key=lambda s: s.index)
    fs.atomic_write_text(
        output / SKIPPED, "".join(json.dumps(s.to_json()) + "\n" for s in rows)
    )


def read_skipped(output: Path) -> list[Skip]:
    path = output / SKIPPED
    if not path.exists():
        return []
    return [Skip.from_json(json.loads(x)) for x in path.read_text().splitlines() if x]


# ----------------------------------------------------------------------------
# The summary
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class ExtractResult:
    """What an extraction or merge produced (the summary the CLI prints)."""

    output: Path
    samples: int = 0
    """Rows of the finished dataset."""
    tokens: int = 0
    bytes: int = 0
    written: int = 0
    """Sample files written by this call (the rest were found by --resume)."""
    written_tokens: int = 0
    seconds: float = 0.0
    """Wall time of the extraction loop (engine work and writes)."""
    skipped: list[Skip] = dataclasses.field(default_factory=list)
    already_complete: bool = False

    @property
    def rejected(self) -> list[Skip]:
        return [s for s in self.skipped if s.stage is SkipStage.VALIDATE]
