"""The extraction run: `extract` feeds planned samples through a patched vLLM
engine and writes their hidden states in the format of `vllm_hs.extract.format`.

Modes: by default one prefill per conversation (prompt states of the whole
rendered conversation, max_tokens=1). With --regenerate the target model writes
the assistant turns itself: every assistant turn, in order, is generated from the
conversation so far (earlier turns already replaced by the model's own answers;
a trailing user message is answered too), and the sample is the last turn's
request: prompt + generated tokens[:-1], its states from that same request
(prompt and output states), loss mask 1 on assistant tokens of earlier turns and
on every generated row.

Two threads: the main thread (`_Run`) steps the engine and keeps it fed; the
writer thread (`vllm_hs.extract.writer.Writer`) checks finished samples and
writes their hs files, so disk writes overlap engine work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import queue
import time
from array import array
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.format import (
    COMPACTION,
    ExtractResult,
    Manifest,
    RegenerateSettings,
    Row,
    Skip,
    SkipStage,
    scan_finished,
)
from vllm_hs.extract.inputs import (
    Conversation,
    LossMaskError,
    Sample,
    plan_samples,
    render_with_mask,
)
from vllm_hs.extract.outdir import finalize, finish_compaction, open_output
from vllm_hs.extract.storage import FP8, reading_note, stored_dtype
from vllm_hs.extract.trainers import sample_files
from vllm_hs.extract.writer import WriteJob, Writer
from vllm_hs.layer_ids import describe_layers

__all__ = [
    "ExtractJob",
    "LoopSettings",
    "ModelFacts",
    "NoBar",
    "extract",
    "prepare",
    "progress_bar",
    "run_samples",
]

logger = logging.getLogger(__name__)


def extract(
    llm: Any,
    conversations: Sequence[Conversation],
    output: Path | str,
    *,
    layers: Sequence[int | str],
    data_sha256: str,
    tokenizer: Any = None,
    buffer_bytes: int = 2 << 30,
    progress: bool = True,
    **options: Any,
) -> ExtractResult:
    """Extract hidden states of ``conversations`` with ``llm`` (a `vllm.LLM`
    started with ``hidden_states_config`` covering ``layers``) into ``output``
    (this shard's directory). See the module docstring for the modes and
    `prepare` for ``options``. At most ``buffer_bytes`` of states are in flight
    or waiting to be written.
    """
    facts = ModelFacts.of(llm.llm_engine.model_config)
    if tokenizer is None:
        tokenizer = facts.load_tokenizer()
    job = prepare(
        facts,
        tokenizer,
        conversations,
        Path(output),
        layers=layers,
        data_sha256=data_sha256,
        buffer_bytes=buffer_bytes,
        **options,
    )
    if job.todo is None:
        return job.result
    started = time.perf_counter()
    run_samples(
        llm.llm_engine,
        tokenizer,
        job.loop,
        job.todo,
        job.result,
        job.rows,
        progress_bar(len(job.todo), progress),
    )
    job.result.seconds = time.perf_counter() - started
    job.finish()
    return job.result


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What an extraction needs to know of the engine's model, from vLLM's
    `ModelConfig` (an engine's, or one built without an engine: see
    `vllm_hs.extract.on_ray`)."""

    model: str
    fingerprint: str
    """SHA-256 of the model's config.json (identifies the model for --resume)."""
    max_model_len: int
    hidden_size: int
    dtype: str
    num_hidden_layers: int
    tokenizer: str
    tokenizer_revision: str | None
    trust_remote_code: bool

    @classmethod
    def of(cls, model_config: Any) -> ModelFacts:
        return cls(
            model=str(model_config.model),
            fingerprint=_model_fingerprint(model_config),
            max_model_len=int(model_config.max_model_len),
            hidden_size=int(model_config.get_hidden_size()),
            dtype=str(model_config.dtype).removeprefix("torch."),
            num_hidden_layers=int(model_config.hf_text_config.num_hidden_layers),
            tokenizer=str(model_config.tokenizer),
            tokenizer_revision=model_config.tokenizer_revision,
            trust_remote_code=bool(model_config.trust_remote_code),
        )

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            self.tokenizer,
            revision=self.tokenizer_revision,
            trust_remote_code=self.trust_remote_code,
        )


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What the engine loop (`run_samples`) needs besides the engine: the same
    for every replica of a run (picklable)."""

    output: Path
    layers: list[int | str]
    hidden_size: int
    stored_dtype: str
    validate: bool
    trainer_format: str
    compress: bool
    max_length: int
    regenerate: RegenerateSettings | None
    chat_template: str | None
    budget_tokens: int
    """At most this many tokens of states in flight or waiting to be written."""

    def writer(self) -> Writer:
        files = sample_files(self.trainer_format, self.compress)
        return Writer(
            self.output,
            len(self.layers),
            self.hidden_size,
            self.validate,
            self.stored_dtype,
            files,
        )


@dataclasses.dataclass
class ExtractJob:
    """A prepared extraction (`prepare`): ``todo`` the samples left to extract
    (None when there is nothing to run: already complete, or finished while
    preparing), ``rows`` what is already written (row -> `Row`), and `finish`
    to call once ``todo`` is done."""

    manifest: Manifest
    samples: list[Sample]
    rows: dict[int, Row]
    todo: list[Sample] | None
    loop: LoopSettings
    result: ExtractResult

    def finish(self) -> None:
        """Close gaps, write the dataset and the complete manifest."""
        finalize(self.loop.output, self.samples, self.rows, self.manifest, self.result)


def prepare(
    facts: ModelFacts,
    tokenizer: Any,
    conversations: Sequence[Conversation],
    output: Path,
    *,
    layers: Sequence[int | str],
    data_sha256: str,
    max_length: int | None = None,
    regenerate: bool = False,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    num_shards: int = 1,
    shard_index: int = 0,
    resume: bool = False,
    chat_template: str | None = None,
    validate: bool = True,
    buffer_bytes: int = 2 << 30,
    data: str | None = None,
    engine_options: dict[str, Any] | None = None,
    storage_dtype: str = "auto",
    trainer_format: str = "speculators",
    compress: bool = False,
) -> ExtractJob:
    """Check the options, open ``output`` (new, or --resume) with its manifest,
    plan the samples and find those already written.

    ``max_length`` defaults to the engine's ``max_model_len - 1``. ``resume``
    continues a run in ``output`` that was made with the same settings; without
    it ``output`` must not hold a run. ``data`` and ``engine_options`` are only
    recorded in the manifest. ``storage_dtype`` (`vllm_hs.extract.storage`):
    "auto" (the model's dtype), "bfloat16", "float16" or "fp8".
    ``trainer_format`` (`vllm_hs.extract.trainers`): "speculators",
    "specforge" (``compress``: gzipped files) or "modelopt".
    """
    max_model_len = facts.max_model_len
    if max_length is None:
        max_length = max_model_len - 1
    elif max_length > max_model_len - 1:
        raise VllmHsError(
            f"--max-length {max_length} exceeds what the engine can take "
            f"(max_model_len {max_model_len} - 1 for the sampled token); raise "
            "the engine's --max-model-len or lower --max-length"
        )
    layers = list(layers)
    hidden, dtype = facts.hidden_size, facts.dtype
    stored = stored_dtype(storage_dtype, dtype)
    num_hidden_layers = facts.num_hidden_layers
    files = sample_files(trainer_format, compress)
    files.check_layers(layers, num_hidden_layers)
    if stored == FP8 and not files.stores_fp8:
        raise VllmHsError(
            f"--storage-dtype fp8 is speculators' layout; {trainer_format} cannot "
            "read its scales (use bfloat16)"
        )
    template = chat_template if chat_template is not None else tokenizer.chat_template
    manifest = Manifest(
        model=facts.model,
        model_config_sha256=facts.fingerprint,
        data_sha256=data_sha256,
        chat_template_sha256=hashlib.sha256((template or "").encode()).hexdigest(),
        layers=layers,
        columns=describe_layers(layers, num_hidden_layers),
        num_hidden_layers=num_hidden_layers,
        dtype=stored,
        model_dtype=None if stored == dtype else dtype,
        reading=reading_note(stored),
        hidden_size=hidden,
        max_length=max_length,
        regenerate=(
            RegenerateSettings(max_new_tokens, temperature, seed)
            if regenerate
            else None
        ),
        validate=validate,
        num_shards=num_shards,
        shard_index=shard_index,
        data=data,
        engine_options=engine_options,
        format=files.description,
        trainer_format=files.name,
        compress=compress,
    )
    row_bytes = len(layers) * hidden * _dtype_size(dtype)
    loop = LoopSettings(
        output=output,
        layers=layers,
        hidden_size=hidden,
        stored_dtype=stored,
        validate=validate,
        trainer_format=files.name,
        compress=compress,
        max_length=max_length,
        regenerate=manifest.regenerate,
        chat_template=chat_template,
        budget_tokens=max(1, buffer_bytes // row_bytes),
    )
    result = ExtractResult(output=output, layers=layers)
    job = ExtractJob(manifest, [], {}, None, loop, result)
    previous = open_output(output, manifest, resume)
    if previous is not None and previous.complete:
        logger.info("%s: already complete (%s samples)", output, previous.samples)
        result.already_complete = True
        result.samples = previous.samples or 0
        result.tokens = previous.tokens or 0
        result.bytes = previous.bytes or 0
        return job
    if (output / COMPACTION).exists():
        # Interrupted while closing gaps at the very end: only renames were left.
        finish_compaction(output, manifest, result)
        return job

    samples, skipped = plan_samples(
        conversations,
        tokenizer,
        max_length=max_length,
        regenerate=regenerate,
        num_shards=num_shards,
        shard_index=shard_index,
        chat_template=chat_template,
    )
    for skip in skipped:
        logger.info("skipping conversation %d: %s", skip.index, skip.reason)
    result.skipped.extend(skipped)
    rows = scan_finished(output, samples, len(layers), hidden, files)
    if rows:
        logger.info(
            "resuming: %d of %d samples already written", len(rows), len(samples)
        )
    job.samples, job.rows = samples, rows
    job.todo = [s for s in samples if s.row not in rows]
    return job


def run_samples(
    engine: Any,
    tokenizer: Any,
    loop: LoopSettings,
    todo: list[Sample],
    result: ExtractResult,
    rows: dict[int, Row],
    bar: Any = None,
) -> None:
    """Extract ``todo`` with ``engine`` (a `vllm.LLMEngine`): each sample is
    written (its `Row` added to ``rows``, counted in ``result``) or skipped (in
    ``result.skipped``); ``bar`` (a tqdm-like progress bar) advances per sample."""
    run = _Run(
        engine,
        tokenizer,
        result,
        rows,
        loop.writer(),
        layers=loop.layers,
        max_length=loop.max_length,
        regenerate=loop.regenerate,
        chat_template=loop.chat_template,
        budget_tokens=loop.budget_tokens,
    )
    run.run(todo, bar if bar is not None else NoBar())


# ----------------------------------------------------------------------------
# Data between the stages
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    """A request in the engine: one round of a sample.

    Default mode: round 0 is the only round, ``prompt_ids`` the whole rendered
    conversation. --regenerate: round r generates message ``sample.slots[r]``;
    only the last round (``r == len(sample.slots) - 1``) asks for hidden states.
    ``len(prompt_mask) == len(prompt_ids) <= max_length``.
    """

    sample: Sample
    round_index: int
    prompt_ids: Sequence[int]
    prompt_mask: Sequence[int]


# ----------------------------------------------------------------------------
# The engine loop
# ----------------------------------------------------------------------------


class _Run:
    """The extraction loop: keeps the engine fed with requests (at most
    ``budget_tokens`` of states in flight or waiting for the writer), hands
    finished samples to the writer thread, and records what it wrote in
    ``rows`` (row -> `Row`).

    Invariants: a sample's row is in ``outstanding`` from its first request
    until the writer reported on it or it was skipped (then ``_release``
    advances the progress bar); ``waiting`` holds the rows submitted to the
    writer and not yet reported; ``histories`` the conversations --regenerate is
    rewriting, between rounds.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        result: ExtractResult,
        rows: dict[int, Row],
        writer: Writer,
        *,
        layers: list[int | str],
        max_length: int,
        regenerate: RegenerateSettings | None,
        chat_template: str | None,
        budget_tokens: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.result = result
        self.rows = rows
        self.writer = writer
        self.layers = layers
        self.max_length = max_length
        self.regenerate = regenerate
        self.chat_template = chat_template
        self.budget_tokens = budget_tokens
        self.inflight: dict[str, _Request] = {}  # request id -> request
        self.outstanding: dict[int, int] = {}  # row -> tokens held
        self.outstanding_tokens = 0
        self.histories: dict[int, Conversation] = {}
        self.waiting: dict[int, Row] = {}
        self.bar: Any = NoBar()
        self.started = 0.0
        self._prompt_params: Any = None  # default mode: one SamplingParams for all

    def run(self, todo: list[Sample], bar: Any) -> None:
        """Extract ``todo``."""
        self.bar, self.started = bar, time.perf_counter()
        pending = deque(todo)
        try:
            while pending or self.outstanding:
                while pending and (
                    not self.outstanding
                    or self.outstanding_tokens + self._cost(pending[0])
                    <= self.budget_tokens
                ):
                    sample = pending.popleft()
                    self._hold(sample.row, self._cost(sample))
                    self._add(sample, 0)
                if self.inflight:
                    for request_output in self.engine.step():
                        if request_output.finished:
                            self._finish(request_output)
                    self._drain(block=False)
                elif self.outstanding:
                    self._drain(block=True)
        except BaseException:
            self._abort()
            raise
        finally:
            self.writer.close()
            self.bar.close()
        self._drain(block=False)

    def _cost(self, sample: Sample) -> int:
        if self.regenerate is None:
            return len(sample.input_ids)
        return len(sample.input_ids) + self.regenerate.max_new_tokens * len(
            sample.slots
        )

    def _hold(self, row: int, tokens: int) -> None:
        self.outstanding[row] = tokens
        self.outstanding_tokens += tokens

    def _release(self, row: int) -> None:
        self.outstanding_tokens -= self.outstanding.pop(row, 0)
        self.bar.update(1)

    def _abort(self) -> None:
        with contextlib.suppress(Exception):
            if self.inflight:
                self.engine.abort_request(list(self.inflight))
                self.inflight.clear()
            while self.engine.has_unfinished_requests():
                self.engine.step()

    def _skip(self, sample: Sample, reason: str, stage: SkipStage) -> None:
        self.result.skipped.append(Skip(sample.index, reason, stage))
        logger.info("skipping conversation %d: %s", sample.index, reason)
        self.histories.pop(sample.row, None)
        self._release(sample.row)

    def _add(self, sample: Sample, round_index: int) -> None:
        """Send round ``round_index`` of a sample to the engine (default mode: the
        only round; --regenerate: one round per slot)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        settings = self.regenerate
        if settings is None:
            if self._prompt_params is None:
                # The engine copies the parameters of each request it takes.
                self._prompt_params = SamplingParams(
                    max_tokens=1,
                    temperature=0.0,
                    detokenize=False,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    hidden_states={
                        "layers": self.layers,
                        "prompt": True,
                        "output": False,
                    },
                )
            params = self._prompt_params
            ids, mask = sample.input_ids, sample.loss_mask
        else:
            if round_index == 0:
                ids, mask = sample.input_ids, sample.loss_mask
            else:
                history = self.histories[sample.row]
                slot = sample.slots[round_index]
                try:
                    ids, mask = render_with_mask(
                        self.tokenizer,
                        history[:slot],
                        add_generation_prompt=True,
                        chat_template=self.chat_template,
                    )
                except LossMaskError as e:
                    reason = f"turn {round_index + 1}: {e}"
                    self._skip(sample, reason, SkipStage.GENERATE)
                    return
                if len(ids) >= self.max_length:
                    self._skip(
                        sample,
                        f"turn {round_index + 1}: generation prompt of {len(ids)} "
                        f"tokens leaves no room within --max-length {self.max_length}",
                        SkipStage.GENERATE,
                    )
                    return
            last = round_index == len(sample.slots) - 1
            params = SamplingParams(
                max_tokens=min(settings.max_new_tokens, self.max_length + 1 - len(ids)),
                temperature=settings.temperature,
                seed=(
                    (settings.seed + sample.index) if settings.temperature > 0 else None
                ),
                output_kind=RequestOutputKind.FINAL_ONLY,
                hidden_states=(
                    {"layers": self.layers, "prompt": True, "output": True}
                    if last
                    else None
                ),
            )
        request_id = f"vllm-hs-extract-{sample.row}-{round_index}"
        self.engine.add_request(request_id, {"prompt_token_ids": list(ids)}, params)
        self.inflight[request_id] = _Request(sample, round_index, ids, mask)

    def _finish(self, request_output: Any) -> None:
        request = self.inflight.pop(request_output.request_id)
        sample, round_index = request.sample, request.round_index
        ids, mask = request.prompt_ids, request.prompt_mask
        completion = request_output.outputs[0]
        if completion.finish_reason not in ("length", "stop"):
            reason = f"the engine ended the request with {completion.finish_reason!r}"
            self._skip(sample, reason, SkipStage.VALIDATE)
            return
        if list(request_output.prompt_token_ids) != list(ids):
            reason = "the engine saw other prompt token ids"
            self._skip(sample, reason, SkipStage.VALIDATE)
            return
        if self.regenerate is None:
            self._write(sample, request_output.prompt_hidden_states, ids, mask)
            return
        if round_index < len(sample.slots) - 1:
            history = self.histories.setdefault(sample.row, list(sample.messages))
            slot = sample.slots[round_index]
            turn = {"role": "assistant", "content": completion.text}
            if slot < len(history):
                history[slot] = turn
            else:
                history.append(turn)
            self._add(sample, round_index + 1)
            return
        import torch

        self.histories.pop(sample.row, None)
        prompt_states = request_output.prompt_hidden_states
        output_states = completion.hidden_states
        if prompt_states is None or output_states is None:
            reason = "the engine returned no hidden states"
            self._skip(sample, reason, SkipStage.VALIDATE)
            return
        generated = list(completion.token_ids)
        token_ids = list(ids) + generated[:-1]
        loss_mask = list(mask) + [1] * (len(generated) - 1)
        if not any(loss_mask):
            reason = "no assistant tokens (nothing generated)"
            self._skip(sample, reason, SkipStage.GENERATE)
            return
        states = torch.cat([prompt_states, output_states])
        self._write(sample, states, token_ids, loss_mask)

    def _write(
        self, sample: Sample, states: Any, ids: Sequence[int], mask: Sequence[int]
    ) -> None:
        row = Row(array("i", ids), bytes(mask))
        self.waiting[sample.row] = row
        self.writer.submit(WriteJob(sample, states, row))

    def _drain(self, block: bool) -> None:
        """Collect what the writer finished (waits for one result if ``block``)."""
        while True:
            try:
                done = self.writer.done.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                if not block:
                    return
                if not self.writer.thread.is_alive():
                    raise VllmHsError("the writer thread died") from None
                continue
            block = False
            if self.writer.error is not None:
                raise self.writer.error
            row = self.waiting.pop(done.row)
            if done.problem is not None:
                skip = Skip(done.index, done.problem, SkipStage.VALIDATE)
                self.result.skipped.append(skip)
                logger.info("not writing conversation %d: %s", done.index, done.problem)
            else:
                self.rows[done.row] = row
                self.result.written += 1
                self.result.written_tokens += done.tokens
                self.result.bytes += done.bytes
                elapsed = max(time.perf_counter() - self.started, 1e-9)
                self.bar.set_postfix_str(
                    f"{self.result.written_tokens / elapsed:,.0f} tok/s", refresh=False
                )
            self._release(done.row)


# ----------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------


def _model_fingerprint(model_config: Any) -> str:
    """SHA-256 of the model's config.json (identifies the model for --resume)."""
    model = Path(str(model_config.model))
    config = model / "config.json"
    data = config.read_bytes() if config.exists() else str(model_config.model).encode()
    return hashlib.sha256(data).hexdigest()


def _dtype_size(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


class NoBar:
    """A progress bar that shows nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool) -> Any:
    """The progress bar of ``total`` samples (tqdm), or `NoBar`."""
    if not enabled:
        return NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="extract", dynamic_ncols=True)
