"""`vllm-hs extract` on the command line: the parser (extract's options plus
vLLM's engine options), checks of the cheap inputs before an engine starts, the
engine, and the summary on stdout.

vLLM's engine options: importing vLLM to declare them takes seconds, and
`vllm-hs --help` imports every command module, so the extract parser declares
them only when a command line needs them: when it holds an option extract does
not define itself (`_ExtractParser`). Options after ``--`` are parsed separately
by vLLM's own parser (`_engine_overrides`), which also reads its shorthands.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_hs.command import ArgumentParser
from vllm_hs.errors import VllmHsError, import_extra
from vllm_hs.extract.format import SKIPPED, ExtractResult, merge_shards, shard_dir
from vllm_hs.extract.inputs import (
    ConversationError,
    load_conversations,
    shipped_conversations_path,
)
from vllm_hs.extract.on_ray import check_ray_options
from vllm_hs.extract.runner import extract
from vllm_hs.extract.storage import STORAGE_CHOICES
from vllm_hs.extract.trainers import FORMATS, sample_files
from vllm_hs.layer_ids import parse_layers
from vllm_hs.patched_vllm import import_patched_vllm

__all__ = ["DEFAULT_OUTPUT", "EMBEDDED_ENGINE_DEFAULTS", "add_parser", "run"]

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path("vllm-hs-extract-out")

#: Engine options for the embedded tiny model (the user's options win).
EMBEDDED_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # vLLM on CPU would run the fp32 checkpoint in bf16
    "kv_cache_memory_bytes": 256 << 20,
    "enforce_eager": True,  # compiling costs more than the whole tiny job
}

#: Prefix of the namespace names of vLLM's engine options (keeps them apart from
#: extract's own).
ENGINE_DEST_PREFIX = "engine_option__"

#: Engine options extract sets from its own options.
_OWN_ENGINE_OPTIONS = {
    "model": "--model",
    "seed": "--seed",
    "hidden_states_config": "--layers",
}


EPILOG = """\
output (speculators >= 0.5 offline format; train with speculators'
ArrowDataset(datapath=OUTPUT) or train.py --data-path OUTPUT):

  OUTPUT/data-*.arrow, dataset_info.json, state.json   Arrow dataset: input_ids
      int64 [T], loss_mask int64 0/1 [T], seq_len int (one row per sample)
  OUTPUT/hidden_states/hs_{i}.safetensors   row i: hidden_states [T, K, H] in
      the model dtype or --storage-dtype (columns = --layers), token_ids int64
      [T]; with --storage-dtype fp8 also hidden_states_scales float32 [T, 1, 1]
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

vLLM engine options: every engine option of 'vllm serve' (vLLM's EngineArgs:
--dtype, --max-model-len, --tensor-parallel-size, --max-num-batched-tokens,
--enforce-eager, ...; see 'vllm serve --help=all') is an option of extract too,
or goes after '--', where vLLM's own parser reads it with its shorthands (-O3,
--compilation-config.KEY VALUE, --config FILE.yaml); an option given both ways
takes the value after '--'. Names both define are extract's: --model is the
model the engine runs (default: the embedded tiny model), --seed N seeds both
the engine and --regenerate's sampling. --layers sets the engine's
--hidden-states-config. The embedded model runs with --dtype float32
--enforce-eager --kv-cache-memory-bytes 256MiB unless these are given.
--max-length is the longest sample (the engine's --max-model-len - 1 by
default; raise --max-model-len for longer samples).

fp8 storage: hidden_states float8_e4m3fn and one float32 scale per token over
all its layers (amax / 448), the layout of hs-connectors' FP8HiddenStatesConnector.
Read it through hs_connectors.transfer.FP8Transfer, e.g.
ArrowDataset(datapath=OUTPUT, transfer=FP8Transfer(OUTPUT / "hidden_states")),
or 'speculators train --hidden-states-backend fp8': speculators'
check_hidden_states cannot read these files, and its default reader would hand
the fp8 values to training without their scales.

other trainers (--format; default layers then [2, L//2, L-3, final_norm]: the
last column must be final_norm, what their LM head reads; trainer aux id a =
vllm-hs id a + 1):

  specforge   OUTPUT/hidden_states/rows_{g}-{g+2000}/data_{i}.ckpt (.ckpt.gz with
      --compress): torch.save of input_ids, loss_mask int64 [T], hidden_state
      [1, T, H] (final_norm), aux_hidden_state [1, T, 3H] (exactly 3 aux layers);
      train with --hidden-states-path OUTPUT/hidden_states (SpecForge wants
      bfloat16: --dtype bfloat16 or --storage-dtype bfloat16)
  modelopt    OUTPUT/hidden_states/{conversation_id}.pt (conversation_id = input
      index): torch.save of input_ids, loss_mask [T], hidden_states [T, H]
      (final_norm), aux_hidden_states [T, K*H], conversation_id; train with
      data.offline_data_path=OUTPUT/hidden_states (loss_mask is read only with
      training.answer_only_loss=true)
  Neither gets the Arrow dataset or token_freq.pt; --storage-dtype fp8 is
  speculators' only.

Ray (--ray, vllm-hs[ray]): the driver plans the samples and writes the
manifest and the dataset; --replicas N engines in Ray actors (Ray Data's
actor pool) extract batches of samples and write their files into OUTPUT
themselves. The output is the dataset a run without Ray writes, and --resume
continues a killed run with or without Ray. Every node needs the patched vLLM,
vllm-hs, the model at the same path (or hub id) and OUTPUT on a shared file
system at the same path; replicas get the driver's VLLM_*, HF_*, OMP_* and
VLLM_HS_CACHE variables, and GPUs (tensor x pipeline parallel size each) when
the cluster has any. Multi-node:
  node 1:  ray start --head --port 6379
  others:  ray start --address HEAD_IP:6379
  node 1:  vllm-hs extract --model M --data D --output /shared/O \
               --ray auto --replicas 8 --tensor-parallel-size 1
Without a shared file system: one shard per node (--num-shards S --shard-index
I, with or without --ray), then copy the shard directories into one OUTPUT and
--merge.

file modes: every file is written with the mode the umask gives new files
(umask 022: 0644).

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
        # Same parser, plus vLLM's engine options on demand (see _ExtractParser).
        parser.__class__ = _ExtractParser
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


class _ExtractParser(ArgumentParser):
    """The extract parser: declares vLLM's engine options (`add_engine_options`)
    the first time it parses a command line holding an option it does not know,
    so that --help, --merge and input errors never import vLLM."""

    engine_options_added = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if not self.engine_options_added and self._has_unknown_option(argv):
            add_engine_options(self)
        return super().parse_known_args(argv, namespace)

    def _has_unknown_option(self, argv: Sequence[str]) -> bool:
        known = self._option_string_actions
        for arg in argv:
            if arg == "--":
                return False
            if not arg.startswith("-") or self._negative_number_matcher.match(arg):
                continue
            name = arg.split("=", 1)[0]
            if name in known or (
                self.allow_abbrev
                and name.startswith("--")
                and any(option.startswith(name) for option in known)
            ):
                continue
            return True
        return False


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Declare vLLM's engine options (``EngineArgs.add_cli_args``) on ``parser``,
    help suppressed (the epilog explains them), except those extract defines
    itself (--model, --seed). Their namespace names get `ENGINE_DEST_PREFIX`, and
    they are set only when given. Without an importable vLLM nothing is added
    (argparse then reports the option as unrecognized)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        logger.debug("vLLM's engine options are unavailable: %s", e)
        return
    source = FlexibleArgumentParser(add_help=False)
    EngineArgs.add_cli_args(source)
    own = parser._option_string_actions
    for action in source._actions:
        if any(option in own for option in action.option_strings):
            continue
        action.dest = ENGINE_DEST_PREFIX + action.dest
        action.default = argparse.SUPPRESS
        action.help = argparse.SUPPRESS
        parser._add_action(action)
    if isinstance(parser, _ExtractParser):
        parser.engine_options_added = True


def _given_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given directly (EngineArgs field -> value)."""
    return {
        key.removeprefix(ENGINE_DEST_PREFIX): value
        for key, value in vars(args).items()
        if key.startswith(ENGINE_DEST_PREFIX)
    }


def _check_own_options(options: dict[str, Any], where: str) -> None:
    for key, option in _OWN_ENGINE_OPTIONS.items():
        if key in options:
            raise VllmHsError(f"pass {option} to vllm-hs extract, not {where}")


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
    _check_own_options(overrides, "after --")
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
    given = _given_engine_options(args)
    _check_own_options(given, "--hidden-states-config")
    if args.merge:
        if engine_argv or given or args.ray is not None:
            raise VllmHsError(
                "--merge starts no engine: drop the engine options and --ray"
            )
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
    if args.ray is None and (args.replicas != 1 or args.ray_batch_size is not None):
        raise VllmHsError("--replicas and --ray-batch-size need --ray")
    check_ray_options(args.replicas, args.ray_batch_size)
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

    LLM = import_patched_vllm().LLM
    import_extra("datasets", "writing the Arrow dataset")

    engine_kwargs: dict[str, Any] = {}
    if args.model is None:
        from vllm_hs.models.tiny import build_tiny_model

        model = str(build_tiny_model("llama", "float32"))
        engine_kwargs.update(EMBEDDED_ENGINE_DEFAULTS)
    else:
        model = args.model
    engine_kwargs.update(given)
    engine_kwargs.update(_engine_overrides(engine_argv))
    engine_kwargs["seed"] = args.seed
    num_hidden_layers = _num_hidden_layers(model, engine_kwargs)
    files = sample_files(args.format, args.compress)
    if args.layers is None:
        layers = files.default_layers(num_hidden_layers)
    else:
        layers = parse_layers(args.layers, num_hidden_layers)
    files.check_layers(layers, num_hidden_layers)
    if files.name == "speculators" and layers[-1] != num_hidden_layers:
        logger.warning(
            "note: the last layer is %r, not %d (the last decoder layer before the "
            "final norm), which speculators reads the last column as",
            layers[-1],
            num_hidden_layers,
        )
    output = args.output
    if args.num_shards > 1:
        output = shard_dir(output, args.shard_index, args.num_shards)
    logger.info("model: %s", model)
    logger.info("data: %s (%d conversations)", data, len(conversations))
    logger.info("layers: %s; output: %s", layers, output)

    options: dict[str, Any] = dict(
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
        data=str(data),
        engine_options=_jsonable(engine_kwargs),
        storage_dtype=args.storage_dtype,
        trainer_format=args.format,
        compress=args.compress,
    )
    replicas: dict[str, Any] = {}
    if args.ray is not None:
        from vllm_hs.extract.on_ray import extract_on_ray

        result, replicas = extract_on_ray(
            model,
            engine_kwargs,
            conversations,
            output,
            address=None if args.ray == "local" else args.ray,
            replicas=args.replicas,
            batch_size=args.ray_batch_size,
            **options,
        )
    else:
        llm = LLM(model=model, hidden_states_config={"layers": layers}, **engine_kwargs)
        try:
            result = extract(llm, conversations, output, **options)
        finally:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
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
            output / SKIPPED,
        )
        code = 1
    elif result.samples == 0:
        logger.error("nothing was written: every conversation was skipped")
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
