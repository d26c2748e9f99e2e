"""`vllm-hs extract` on the command line: the parser (extract's options; vLLM's
engine options come from `vllm_hs.extract.engine_options`), the one place
where the options become `ExtractSettings` (checked there, before an engine
starts), the run (one engine here, or Ray), and the summary on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from vllm_hs.command import ArgumentParser
from vllm_hs.errors import VllmHsError, import_extra
from vllm_hs.extract.engine import ModelFacts, start_engine, stop_engine
from vllm_hs.extract.engine_options import (
    ExtractParser,
    check_own_options,
    engine_options,
    given_engine_options,
)
from vllm_hs.extract.formats import FORMATS, sample_files
from vllm_hs.extract.inputs import (
    Conversation,
    ConversationError,
    load_conversations,
    shipped_conversations_path,
)
from vllm_hs.extract.job import extract
from vllm_hs.extract.outdir import merge_shards, shard_dir
from vllm_hs.extract.records import SKIPPED, ExtractResult
from vllm_hs.extract.settings import ExtractSettings, RayOptions, RegenerateSettings
from vllm_hs.extract.storage import STORAGE_CHOICES
from vllm_hs.layer_ids import LayerId, parse_layers
from vllm_hs.patched_vllm import import_patched_vllm

__all__ = ["DEFAULT_OUTPUT", "add_parser", "run"]

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path("vllm-hs-extract-out")

EPILOG = """\
The guide, docs/extract.md in the source tree, describes the output files of
each --format, layer ids, sharding and --merge, vLLM's engine options, fp8
storage, Ray, and file modes.

examples:
  vllm-hs extract                                    # tiny model, shipped data
  vllm-hs extract --model meta-llama/Llama-3.1-8B-Instruct --data chats.jsonl \\
      --output ./llama-hs --max-num-batched-tokens 8192 --dtype bfloat16
  vllm-hs extract --model M --data D --output O -- -O3 --max-num-seqs 64
  vllm-hs extract --model M --data D --output O --num-shards 4 --shard-index 1
  vllm-hs extract --output O --merge
  vllm-hs extract --model M --data D --output O --ray --replicas 2
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
            "conversation set shipped with vllm-hs. vLLM's engine options "
            "(--dtype, --max-model-len, ...) are accepted as for 'vllm serve', "
            "directly or after '--'."
        ),
        epilog=EPILOG,
    )
    if type(parser) is ArgumentParser:
        # Same parser, plus vLLM's engine options on demand (see ExtractParser).
        parser.__class__ = ExtractParser
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="model directory or HF id, vLLM's --model (default: the embedded "
        "tiny seeded Llama, built once into the vllm-hs cache, run in float32 "
        "and eager mode)",
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
        help="base sampling seed of --regenerate, and vLLM's engine --seed "
        "(default: %(default)s)",
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
        "--storage-dtype",
        choices=STORAGE_CHOICES,
        default="auto",
        help="dtype of hidden_states in the hs files: auto = the model's; "
        "bfloat16/float16 round each value (a sample beyond float16's range is "
        "rejected); fp8 = speculators' FP8 layout (float8_e4m3fn with a float32 "
        "scale per token in hidden_states_scales; read it through "
        "hs-connectors' FP8Transfer, see below) (default: %(default)s)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="speculators",
        help="the trainer whose offline format to write (see below): speculators "
        "(default), specforge or modelopt",
    )
    parser.add_argument(
        "--compress",
        action="store_true",
        help="--format specforge: gzip each sample (.ckpt.gz)",
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
        "--ray",
        metavar="ADDRESS",
        nargs="?",
        const="local",
        default=None,
        help="run on Ray (needs vllm-hs[ray]): without ADDRESS on a local Ray "
        "cluster started for the run; 'auto', HOST:PORT or ray://HOST:PORT joins "
        "an existing one. OUTPUT must be on a file system every node sees at the "
        "same path (see below)",
    )
    parser.add_argument(
        "--replicas",
        metavar="N",
        type=int,
        default=1,
        help="--ray: engines to run, one per Ray actor, each with the engine "
        "options given (default: %(default)s)",
    )
    parser.add_argument(
        "--ray-batch-size",
        metavar="N",
        type=int,
        default=None,
        help="--ray: samples a replica takes at a time (default: a quarter of "
        "each replica's share, at most 64)",
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
        help="vLLM engine options after '--', read by vLLM's own parser (see "
        "'vllm serve --help'), e.g. -- --max-num-batched-tokens 2048 -O3",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.model is None:  # the embedded model needs no hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    engine_argv = [a for a in args.engine_args if a != "--"]
    given = given_engine_options(args)
    check_own_options(given, "--hidden-states-config")
    if args.merge:
        if engine_argv or given or args.ray is not None:
            raise VllmHsError(
                "--merge starts no engine: drop the engine options and --ray"
            )
        result = merge_shards(args.output)
        _print_summary(result, None, 0.0)
        return 0
    if args.ray is None and (args.replicas != 1 or args.ray_batch_size is not None):
        raise VllmHsError("--replicas and --ray-batch-size need --ray")
    started = time.perf_counter()
    conversations, settings, facts = _settings(args, engine_argv)
    replicas: dict[str, Any] = {}
    if settings.ray is not None:
        from vllm_hs.extract.on_ray import extract_on_ray

        result, replicas = extract_on_ray(conversations, settings, facts)
    else:
        assert settings.model is not None and settings.engine_options is not None
        llm = start_engine(settings.model, settings.engine_options, settings.layers)
        try:
            result = extract(llm, conversations, settings)
        finally:
            stop_engine(llm)
    _print_summary(result, started, result.seconds)
    for name, stats in sorted(replicas.items()):
        print(
            f"replica {name}: {stats.samples} samples, {stats.tokens} tokens in "
            f"{stats.seconds:.1f} s, {stats.tokens_per_s:,.0f} tokens/s"
        )
    code = 0
    if result.rejected:
        logger.error(
            "FAILED validation: %d sample(s) were not written (see %s)",
            len(result.rejected),
            settings.output / SKIPPED,
        )
        code = 1
    elif result.samples == 0:
        logger.error("nothing was written: every conversation was skipped")
        code = 1
    return code


def _settings(
    args: argparse.Namespace, engine_argv: list[str]
) -> tuple[list[Conversation], ExtractSettings, ModelFacts]:
    """The conversations, the run's settings and the model's facts; raises
    VllmHsError before any engine starts. The cheap checks come first: the
    Ray and --regenerate options, then the data, then what needs the model."""
    ray = None
    if args.ray is not None:
        address = None if args.ray == "local" else args.ray
        ray = RayOptions(address, args.replicas, args.ray_batch_size)
    regenerate = RegenerateSettings(args.max_new_tokens, args.temperature, args.seed)
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

    import_patched_vllm()
    import_extra("datasets", "writing the Arrow dataset")
    if args.model is None:
        from vllm_hs.models.tiny import build_tiny_model

        model = str(build_tiny_model("llama", "float32"))
    else:
        model = args.model
    options = engine_options(args, engine_argv, embedded=args.model is None)
    facts = ModelFacts.planned(model, options)
    layers = _layers(args, facts.num_hidden_layers)
    output = args.output
    if args.num_shards > 1:
        output = shard_dir(output, args.shard_index, args.num_shards)
    settings = ExtractSettings(
        output=output,
        layers=tuple(layers),
        data_sha256=data_sha256,
        data=str(data),
        model=model,
        engine_options=options,
        max_length=args.max_length,
        regenerate=regenerate if args.regenerate else None,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        resume=args.resume,
        chat_template=chat_template,
        validate=args.validate,
        storage_dtype=args.storage_dtype,
        trainer_format=args.format,
        compress=args.compress,
        buffer_bytes=args.buffer_mib << 20,
        progress=args.progress,
        ray=ray,
    )
    logger.info("model: %s", model)
    logger.info("data: %s (%d conversations)", data, len(conversations))
    logger.info("layers: %s; output: %s", layers, output)
    return conversations, settings, facts


def _layers(args: argparse.Namespace, num_hidden_layers: int) -> list[LayerId]:
    """--layers resolved against the model, or the trainer format's default."""
    if args.layers is None:
        return sample_files(args.format, args.compress).default_layers(
            num_hidden_layers
        )
    layers = parse_layers(args.layers, num_hidden_layers)
    if args.format == "speculators" and layers[-1] != num_hidden_layers:
        logger.warning(
            "note: the last layer is %r, not %d (the last decoder layer before the "
            "final norm), which speculators reads the last column as",
            layers[-1],
            num_hidden_layers,
        )
    return layers


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
