"""`vllm-hs extract` on the command line: the parser, generated from the
options `ExtractSettings` declares (vLLM's engine options are read by
`vllm_hs.extract.engine_options`), the one place where the options become
`ExtractSettings` (checked there, before an engine starts), the run (one engine
here, or Ray), and the summary on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from vllm_hs.command import Subparsers, accept_unknown_options
from vllm_hs.errors import VllmHsError, import_extra
from vllm_hs.extract.engine import ModelFacts, start_engine, stop_engine
from vllm_hs.extract.engine_options import engine_options
from vllm_hs.extract.formats import sample_files
from vllm_hs.extract.images import has_images
from vllm_hs.extract.inputs import (
    Conversation,
    ConversationError,
    load_conversations,
    shipped_conversations_path,
)
from vllm_hs.extract.job import check_images, extract
from vllm_hs.extract.outdir import merge_shards, shard_dir
from vllm_hs.extract.records import SKIPPED, ExtractResult
from vllm_hs.extract.settings import (
    DEFAULT_OUTPUT,
    ExtractSettings,
    RayOptions,
    RegenerateSettings,
)
from vllm_hs.field_options import Flag, Option, add_options, given_options, options_of
from vllm_hs.patched_vllm import import_patched_vllm

__all__ = ["DEFAULT_OUTPUT", "add_parser", "run"]

logger = logging.getLogger(__name__)

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

ENGINE_OPTIONS_HELP = (
    "Given directly (--dtype bfloat16 --max-num-seqs 64), or last, after '--' "
    "(-- ENGINE_ARGS): read by vLLM's own parser (see 'vllm serve --help'), e.g. "
    "-- --max-num-batched-tokens 2048 -O3"
)

#: extract's one option that is no setting: it starts no extraction.
MERGE = Option(
    "merge",
    "--merge",
    Flag(
        "merge the complete OUTPUT/shard-*-of-S directories into one dataset in "
        "OUTPUT (no engine is started)"
    ),
    False,
)


def command_line_options() -> list[Option]:
    """extract's options, in --help's order: the settings' (what to read
    first: --model, --data), --merge after --resume."""
    options = options_of(ExtractSettings)
    first = [o for o in options if o.name in ("model", "data")]
    rest = [o for o in options if o not in first]
    after = [o.name for o in rest].index("resume") + 1
    return [*first, *rest[:after], MERGE, *rest[after:]]


def add_parser(subparsers: Subparsers) -> None:
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
    add_options(parser, command_line_options())
    parser.add_argument_group("vLLM's engine options", ENGINE_OPTIONS_HELP)
    accept_unknown_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.model is None:  # the embedded model needs no hub
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    unknown: list[str] = getattr(args, "unknown_options", [])
    own = given_options(args, options_of(ExtractSettings, nested=False))
    if args.merge:
        if unknown or own["ray"] is not None:
            raise VllmHsError(
                "--merge starts no engine: drop the engine options and --ray"
            )
        result = merge_shards(own["output"])
        _print_summary(result, None, 0.0)
        return 0
    started = time.perf_counter()
    conversations, settings, facts = _settings(args, own, unknown)
    replicas: dict[str, Any] = {}
    if settings.ray is not None:
        from vllm_hs.extract.on_ray import extract_on_ray

        result, replicas = extract_on_ray(conversations, settings, facts)
    else:
        assert settings.model is not None and settings.engine_options is not None
        assert settings.layers is not None
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
    args: argparse.Namespace, own: dict[str, Any], unknown: list[str]
) -> tuple[list[Conversation], ExtractSettings, ModelFacts]:
    """The conversations, the run's settings and the model's facts; raises
    VllmHsError before any engine starts. ``own``: `ExtractSettings`' options
    as given (parsed and checked). The cheap checks come first: the Ray and
    --regenerate options, then the data, then what needs the model."""
    ray_options = given_options(args, options_of(RayOptions))
    ray = None
    if own["ray"] is not None:
        address = None if own["ray"] == "local" else own["ray"]
        ray = RayOptions(address, **ray_options)
    elif ray_options != {o.name: o.default for o in options_of(RayOptions)}:
        raise VllmHsError("--replicas and --ray-batch-size need --ray")
    regenerate = RegenerateSettings(
        **given_options(args, options_of(RegenerateSettings))
    )
    data: Path = own["data"] or shipped_conversations_path()
    try:
        conversations, data_sha256 = load_conversations(data)
    except ConversationError as e:
        raise VllmHsError(f"--data: {e}") from None
    if not conversations:
        raise VllmHsError(f"--data: {data} holds no conversations")
    if any(has_images(c) for c in conversations):  # before the model is built
        sample_files(own["trainer_format"], own["compress"]).check_images()

    import_patched_vllm()
    import_extra("datasets", "writing the Arrow dataset")
    if own["model"] is None:
        from vllm_hs.models.tiny import build_tiny_model

        model = str(build_tiny_model("llama", "float32"))
    else:
        model = own["model"]
    options = engine_options(
        unknown, seed=regenerate.seed, embedded=own["model"] is None
    )
    facts = ModelFacts.planned(model, options)
    output = own["output"]
    if own["num_shards"] > 1:
        output = shard_dir(output, own["shard_index"], own["num_shards"])
    settings = ExtractSettings(
        **{
            **own,
            "output": output,
            "data": str(data),
            "data_sha256": data_sha256,
            "model": model,
            "engine_options": options,
            "regenerate": regenerate if own["regenerate"] else None,
            "ray": ray,
        }
    ).for_model(facts.num_hidden_layers)
    check_images(conversations, settings, facts)
    assert settings.layers is not None
    last, num_hidden_layers = settings.layers[-1], facts.num_hidden_layers
    if own["layers"] is not None and settings.trainer_format == "speculators":
        if last != num_hidden_layers:
            logger.warning(
                "note: the last layer is %r, not %d (the last decoder layer before "
                "the final norm), which speculators reads the last column as",
                last,
                num_hidden_layers,
            )
    logger.info("model: %s", model)
    logger.info("data: %s (%d conversations)", data, len(conversations))
    logger.info("layers: %s; output: %s", list(settings.layers), output)
    return conversations, settings, facts


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
