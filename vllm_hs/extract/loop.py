"""The engine loop of `vllm-hs extract`: `run_samples` feeds planned samples
through a patched vLLM engine and hands their states to the writer thread
(`vllm_hs.extract.writer.Writer`), so disk writes overlap engine work. The
single-process run (`vllm_hs.extract.job`) and every Ray replica
(`vllm_hs.extract.on_ray`) run it.

Modes: by default one prefill per conversation (prompt states of the whole
rendered conversation, max_tokens=1). With --regenerate the target model writes
the assistant turns itself: every assistant turn, in order, is generated from the
conversation so far (earlier turns already replaced by the model's own answers;
a trailing user message is answered too), and the sample is the last turn's
request: prompt + generated tokens[:-1], its states from that same request
(prompt and output states), loss mask 1 on assistant tokens of earlier turns and
on every generated row.

Images (`vllm_hs.extract.images`): a request whose conversation has images
carries them (``multi_modal_data``, in order; --regenerate: the images of the
conversation so far, every round); the engine expands each image placeholder.
Its prompt must collapse back to the rendered ids (each run of the image token
to one), else the sample fails validation; the sample is the expanded prompt,
its loss mask widened with 0 on every image position, and --max-length applies
to it after expansion (longer: skipped, stage plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import time
from array import array
from collections import deque
from collections.abc import Sequence
from typing import Any

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.engine import ModelFacts
from vllm_hs.extract.images import (
    ImageError,
    expand_loss_mask,
    image_urls,
    load_image,
    messages_json,
)
from vllm_hs.extract.inputs import (
    Conversation,
    LossMaskError,
    Sample,
    render_with_mask,
)
from vllm_hs.extract.records import ExtractResult, Row, Skip, SkipStage
from vllm_hs.extract.settings import ExtractSettings
from vllm_hs.extract.writer import WriteJob, Writer

__all__ = ["LoopSettings", "NoBar", "progress_bar", "run_samples"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What the engine loop needs besides the engine: the run's settings and
    what follows from them for this model; the same for every replica of a run
    (picklable)."""

    settings: ExtractSettings
    hidden_size: int
    stored_dtype: str
    max_length: int
    """--max-length resolved against the model (`vllm_hs.extract.job`)."""
    budget_tokens: int
    """At most this many tokens of states in flight or waiting to be written."""
    image_token_id: int | None = None
    """The model's image token (`ModelFacts.image_token_id`)."""
    with_messages: bool = False
    """Whether every row keeps its conversation (`Row.messages`): the input
    has images."""

    @classmethod
    def of(
        cls,
        settings: ExtractSettings,
        facts: ModelFacts,
        max_length: int,
        with_messages: bool = False,
    ) -> LoopSettings:
        row_bytes = len(settings.layers) * facts.hidden_size * _dtype_size(facts.dtype)
        return cls(
            settings=settings,
            hidden_size=facts.hidden_size,
            stored_dtype=settings.stored_dtype(facts.dtype),
            max_length=max_length,
            budget_tokens=max(1, settings.buffer_bytes // row_bytes),
            image_token_id=facts.image_token_id,
            with_messages=with_messages,
        )

    def writer(self) -> Writer:
        return Writer(
            self.settings.output,
            len(self.settings.layers),
            self.hidden_size,
            self.settings.validate,
            self.stored_dtype,
            self.settings.files,
        )


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
    run = _Run(engine, tokenizer, loop, result, rows)
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
    conversation: Conversation
    """What ``prompt_ids`` render (--regenerate: up to the generated turn)."""
    has_images: bool


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
        loop: LoopSettings,
        result: ExtractResult,
        rows: dict[int, Row],
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.result = result
        self.rows = rows
        self.writer = loop.writer()
        self.layers = list(loop.settings.layers)
        self.max_length = loop.max_length
        self.regenerate = loop.settings.regenerate
        self.chat_template = loop.settings.chat_template
        self.image_token_id = loop.image_token_id
        self.with_messages = loop.with_messages
        self.budget_tokens = loop.budget_tokens
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
        ids: Sequence[int]
        mask: Sequence[int]
        conversation: Conversation = sample.messages
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
                conversation = sample.messages[: sample.slots[0]]
            else:
                history = self.histories[sample.row]
                slot = sample.slots[round_index]
                conversation = history[:slot]
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
        prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
        urls = image_urls(conversation)
        if not urls:
            self.engine.add_request(request_id, prompt, params)
        else:
            try:
                prompt["multi_modal_data"] = {"image": [load_image(u) for u in urls]}
                self.engine.add_request(request_id, prompt, params)
            except (ImageError, ValueError, AssertionError) as e:
                # The engine's processor refuses images it cannot place (no
                # placeholder in the render, too many for the prompt).
                reason = f"the engine refused the images ({type(e).__name__}: {e})"
                self._skip(sample, reason, SkipStage.VALIDATE)
                return
        self.inflight[request_id] = _Request(
            sample, round_index, ids, mask, conversation, bool(urls)
        )

    def _finish(self, request_output: Any) -> None:
        request = self.inflight.pop(request_output.request_id)
        sample, round_index = request.sample, request.round_index
        ids, mask = request.prompt_ids, request.prompt_mask
        completion = request_output.outputs[0]
        if completion.finish_reason not in ("length", "stop"):
            reason = f"the engine ended the request with {completion.finish_reason!r}"
            self._skip(sample, reason, SkipStage.VALIDATE)
            return
        if request.has_images:
            expanded = [int(t) for t in request_output.prompt_token_ids]
            assert self.image_token_id is not None  # checked before the engine
            wide = expand_loss_mask(ids, mask, expanded, self.image_token_id)
            if wide is None:
                reason = (
                    "the engine's expanded prompt does not collapse back to the "
                    f"rendered token ids (each run of image token "
                    f"{self.image_token_id} to one)"
                )
                self._skip(sample, reason, SkipStage.VALIDATE)
                return
            ids, mask = expanded, wide
        elif list(request_output.prompt_token_ids) != list(ids):
            reason = "the engine saw other prompt token ids"
            self._skip(sample, reason, SkipStage.VALIDATE)
            return
        if self.regenerate is None:
            if not self._fits(sample, len(ids)):
                return
            messages = self._messages(request.conversation)
            states = request_output.prompt_hidden_states
            self._write(sample, states, ids, mask, messages)
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
        if not self._fits(sample, len(token_ids)):
            return
        states = torch.cat([prompt_states, output_states])
        answer = {"role": "assistant", "content": completion.text}
        messages = self._messages([*request.conversation, answer])
        self._write(sample, states, token_ids, loss_mask, messages)

    def _fits(self, sample: Sample, tokens: int) -> bool:
        """Whether a sample of ``tokens`` fits --max-length (only a sample with
        images can outgrow it here, once its images are expanded); skips it if
        not."""
        if tokens <= self.max_length:
            return True
        reason = (
            f"{tokens} tokens after image expansion > --max-length "
            f"{self.max_length} (not truncated)"
        )
        self._skip(sample, reason, SkipStage.PLAN)
        return False

    def _messages(self, conversation: Conversation) -> str | None:
        return messages_json(conversation) if self.with_messages else None

    def _write(
        self,
        sample: Sample,
        states: Any,
        ids: Sequence[int],
        mask: Sequence[int],
        messages: str | None,
    ) -> None:
        row = Row(array("i", ids), bytes(mask), messages)
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
