"""One extraction from start to end: `prepare` (check the settings against the
model, open the output directory with its manifest, plan the samples, find
those already written), the engine loop (`vllm_hs.extract.loop`), then
`ExtractJob.finish` (close gaps, write the dataset and the complete manifest).
`extract` does it all with one engine in this process; the Ray run
(`vllm_hs.extract.on_ray`) shares `prepare` and `finish`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.engine import ModelFacts
from vllm_hs.extract.images import has_images
from vllm_hs.extract.inputs import Conversation, Sample, plan_samples
from vllm_hs.extract.loop import LoopSettings, progress_bar, run_samples
from vllm_hs.extract.manifest import Manifest
from vllm_hs.extract.outdir import (
    finalize,
    finish_compaction,
    open_output,
    scan_finished,
)
from vllm_hs.extract.records import COMPACTION, ExtractResult, Row
from vllm_hs.extract.settings import ExtractSettings

__all__ = ["ExtractJob", "check_images", "extract", "prepare"]

logger = logging.getLogger(__name__)


def extract(
    llm: Any,
    conversations: Sequence[Conversation],
    settings: ExtractSettings,
    tokenizer: Any = None,
) -> ExtractResult:
    """Extract hidden states of ``conversations`` with ``llm`` (a `vllm.LLM`
    started with ``hidden_states_config`` covering ``settings.layers``) into
    ``settings.output``. ``tokenizer``: the model's (default: loaded)."""
    facts = ModelFacts.of(llm.llm_engine.model_config)
    if tokenizer is None:
        tokenizer = facts.load_tokenizer()
    job = prepare(facts, tokenizer, conversations, settings)
    if isinstance(job, ExtractResult):
        return job
    started = time.perf_counter()
    run_samples(
        llm.llm_engine,
        tokenizer,
        job.loop,
        job.todo,
        job.result,
        job.rows,
        progress_bar(len(job.todo), settings.progress),
    )
    job.result.seconds = time.perf_counter() - started
    job.finish()
    return job.result


@dataclasses.dataclass(frozen=True)
class ExtractJob:
    """A prepared extraction: ``todo`` the samples left to extract, ``rows``
    what is already written (row -> `Row`; the loop adds to it), and `finish`
    to call once ``todo`` is done."""

    manifest: Manifest
    loop: LoopSettings
    samples: list[Sample]
    rows: dict[int, Row]
    todo: list[Sample]
    result: ExtractResult

    def finish(self) -> None:
        """Close gaps, write the dataset and the complete manifest."""
        output = self.loop.settings.output
        finalize(output, self.samples, self.rows, self.manifest, self.result)


def prepare(
    facts: ModelFacts,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    settings: ExtractSettings,
) -> ExtractJob | ExtractResult:
    """Check ``settings`` against the model of ``facts`` (its layer ids resolved:
    `ExtractSettings.for_model`), open the output
    directory (new, or --resume of a run with the same settings) with its
    manifest, plan the samples and find those already written. Returns the
    job, or the result when there is nothing to run (already complete, or
    finished here: a crash while closing gaps)."""
    settings = settings.for_model(facts.num_hidden_layers)
    with_images = check_images(conversations, settings, facts)
    max_length = _max_length(settings.max_length, facts.max_model_len)
    template = settings.chat_template
    if template is None:
        template = tokenizer.chat_template
    manifest = Manifest.of(settings, facts, max_length, template)
    output = settings.output
    result = ExtractResult(output=output)
    previous = open_output(output, manifest, settings.resume)
    if previous is not None and previous.complete:
        logger.info("%s: already complete (%s samples)", output, previous.samples)
        result.already_complete = True
        result.samples = previous.samples or 0
        result.tokens = previous.tokens or 0
        result.bytes = previous.bytes or 0
        return result
    if (output / COMPACTION).exists():
        # Interrupted while closing gaps at the very end: only renames were left.
        finish_compaction(output, manifest, result)
        return result

    samples, skipped = plan_samples(
        conversations,
        tokenizer,
        max_length=max_length,
        regenerate=settings.regenerate is not None,
        num_shards=settings.num_shards,
        shard_index=settings.shard_index,
        chat_template=settings.chat_template,
    )
    for skip in skipped:
        logger.info("skipping conversation %d: %s", skip.index, skip.reason)
    result.skipped.extend(skipped)
    rows = scan_finished(
        output,
        samples,
        len(settings.layers),
        facts.hidden_size,
        settings.files,
        facts.image_token_id,
    )
    if rows:
        logger.info(
            "resuming: %d of %d samples already written", len(rows), len(samples)
        )
    return ExtractJob(
        manifest=manifest,
        loop=LoopSettings.of(settings, facts, max_length, with_images),
        samples=samples,
        rows=rows,
        todo=[s for s in samples if s.row not in rows],
        result=result,
    )


def check_images(
    conversations: Sequence[Conversation],
    settings: ExtractSettings,
    facts: ModelFacts | None,
) -> bool:
    """Whether the input has images; if so, raise VllmHsError unless the trainer
    format and the model (when known) take them."""
    if not any(has_images(c) for c in conversations):
        return False
    settings.files.check_images()
    if facts is not None and facts.image_token_id is None:
        raise VllmHsError(
            f"--data holds images, but the model {facts.model} takes none (its "
            "config names no image token)"
        )
    return True


def _max_length(max_length: int | None, max_model_len: int) -> int:
    """--max-length, or its default, checked against the engine's context."""
    if max_length is None:
        return max_model_len - 1
    if max_length > max_model_len - 1:
        raise VllmHsError(
            f"--max-length {max_length} exceeds what the engine can take "
            f"(max_model_len {max_model_len} - 1 for the sampled token); raise "
            "the engine's --max-model-len or lower --max-length"
        )
    return max_length
