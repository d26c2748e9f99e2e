"""Drafts trained on extracted hidden states, served with vLLM's EAGLE-3.

The purpose of extracting hidden states is a draft model that vLLM accepts.
This suite trains the same EAGLE-3 draft, with speculators' own training code
and the same seed, steps and hyperparameters, on states of the same token
sequences obtained in each of these ways:

* ``vllm_hs``: ``vllm-hs extract --regenerate`` (the target writes the
  replies), stored in the model's dtype;
* ``vllm_hs_fp8``: the same with ``--storage-dtype fp8``, read through
  speculators' ``FP8Transfer`` (``--hidden-states-backend fp8``);
* ``native``: vLLM's own ``extract_hidden_states`` connector on the token
  sequences of ``vllm_hs`` (prompt states of each whole sequence);
* ``hf``: HF transformers' forward on the same sequences;

``online`` trains the same draft through speculators' online mode instead:
its ``ArrowDataset`` asks a patched ``vllm serve`` (started with
``respond_in_kv_transfer_params``) for each sample's states and fetches them
by reference (``--hidden-states-backend vllm-hs``, `vllm_hs.client.speculators_online`);
and ``untrained`` (speculators' initialised draft, no step taken) is the
floor. Every dataset shares ``vllm_hs``'s Arrow rows (``input_ids``,
``loss_mask``): only the states differ. Each draft then serves held-out
prompts with ``speculative_config={"method": "eagle3", ...}`` (greedy, 3
speculative tokens), and the engine's counters give the acceptance rate
(accepted / drafted tokens) and the mean acceptance length (1 + accepted /
drafts).

The default target is `vllm_hs.models.structured_target` (a tiny Llama
trained on a synthetic language whose replies follow from the prompt), its
``train`` conversations the data and its ``heldout`` prompts the evaluation.

    python -m benchmarks run acceptance [--model DIR] [--data JSONL]
        [--seed N] [--quick] [--ways LIST] [--work DIR] [--out RESULTS_ROOT]

Aims: vllm_hs >= 0.97 x hf, vllm_hs_fp8 >= 0.98 x vllm_hs, hf well above
untrained. Results (settings, versions, per-draft counts) go to
``<results root>/<release>/acceptance.json`` (default root
``benchmarks/results``). Every stage runs in its own process (one engine
each: `benchmarks.suites.acceptance_stages`); ``--work DIR`` keeps the data
and drafts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.machine import REPO_ROOT
from benchmarks.protocol import option
from benchmarks.result import Result, Summary
from benchmarks.suites.acceptance_stages import KV_CACHE_BYTES, copy_rows, run_stage

WAYS = ("vllm_hs", "vllm_hs_fp8", "native", "hf")
DRAFTS = (*WAYS, "online", "untrained")
AIMS = {"vllm_hs_over_hf": 0.97, "fp8_over_vllm_hs": 0.98}
ENGINE_FLAGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))


@dataclass
class AcceptanceSettings:
    model: str | None = option(
        None, "target model directory (default: the structured target)"
    )
    data: str | None = option(None, "JSONL of conversations")
    seed: int = option(0, "seed of the target, extraction and training")
    quick: bool = option(False, "")
    work: str | None = option(None, "keep the data and drafts here")
    ways: str = option(",".join(DRAFTS), "drafts to train and serve")
    train_conversations: int = 1024
    eval_prompts: int = 64
    max_new_tokens: int = 32
    epochs: int = 5
    num_speculative_tokens: int = 3
    total_seq_len: int = 256
    optimizer: str = "adamw"
    lr: float = 3e-3
    layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.quick:  # about 10 minutes
            self.train_conversations = 512
            self.eval_prompts = 32
            self.epochs = 3


def prepare_inputs(
    settings: AcceptanceSettings, work: Path
) -> tuple[str, Path, list[list[int]]]:
    """(target, training JSONL, held-out prompt token ids)."""
    from transformers import AutoTokenizer

    if settings.model is None:
        from vllm_hs.models.structured_target import build_structured_target

        settings.model = str(build_structured_target(seed=settings.seed))
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    if settings.data is None:
        from vllm_hs.models.structured_target import conversations

        train = conversations(settings.train_conversations, "train")
        heldout = conversations(settings.eval_prompts, "heldout")
    else:
        lines = Path(settings.data).read_text().splitlines()
        every = [_messages(json.loads(line)) for line in lines if line.strip()]
        heldout = every[-settings.eval_prompts :]
        train = every[: -settings.eval_prompts][: settings.train_conversations]
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in train))
    prompts = []
    for conversation in heldout:
        user = [m for m in conversation if m["role"] != "assistant"][
            :1
        ] or conversation[:1]
        ids = tokenizer.apply_chat_template(
            user, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        prompts.append(list(ids))
    return settings.model, data, prompts


def _messages(record: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in record:
        return record["messages"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [
        {"role": roles.get(t["from"], t["from"]), "content": t["value"]}
        for t in record["conversations"]
    ]


def model_layers(model: str) -> list[int]:
    """The extract default for the model: three aux layers, then L."""
    from vllm_hs.layer_ids import default_layers

    config = json.loads((Path(model) / "config.json").read_text())
    config = config.get("text_config", config)
    return list(default_layers(int(config["num_hidden_layers"])))


def start_server(
    model: str, dtype: str, max_model_len: int, settings: AcceptanceSettings, logs: Path
) -> Any:
    """A patched `vllm serve` answering every request's prompt states by
    reference in kv_transfer_params (speculators' online mode)."""
    from vllm_hs_testing.server import ServerProcess

    server = ServerProcess(
        model,
        logs / "online-server.log",
        {"layers": settings.layers, "respond_in_kv_transfer_params": True},
        extra_args=[
            "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--no-enable-prefix-caching",
        ],
    )  # fmt: skip
    server.cmd[server.cmd.index("--dtype") + 1] = dtype
    return server.start().wait_ready(timeout=600)


def extract(
    settings: AcceptanceSettings,
    data: Path,
    out: Path,
    fp8: bool,
    dtype: str,
    log: Path,
) -> float:
    cmd = [
        sys.executable, "-m", "vllm_hs.cli", "extract",
        "--model", str(settings.model),
        "--data", str(data),
        "--output", str(out),
        "--format", "speculators",
        "--regenerate",
        "--max-new-tokens", str(settings.max_new_tokens),
        "--seed", str(settings.seed),
        "--layers", ",".join(map(str, settings.layers)),
        "--no-progress",
    ]  # fmt: skip
    if fp8:
        cmd += ["--storage-dtype", "fp8"]
    # vLLM's engine options: the model's dtype, as every other way computes in
    # (vLLM on CPU would run a float32 checkpoint in bfloat16), and on CPU a
    # KV cache size instead of a memory share.
    cmd += ["--", "--dtype", dtype, *ENGINE_FLAGS]
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"vllm-hs extract failed:\n{tail}")
    return time.perf_counter() - start


def train_args(
    settings: AcceptanceSettings, model: str, data: Path, save: Path, name: str
) -> dict[str, Any]:
    """The train stage's arguments for draft `name` (same seed, epochs and
    hyperparameters for every way)."""
    return {
        "model": model,
        "data": str(data),
        "save": str(save),
        "epochs": settings.epochs,
        "total_seq_len": settings.total_seq_len,
        "seed": settings.seed,
        "layers": settings.layers,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "optimizer": settings.optimizer,
        "lr": settings.lr,
        "fp8": name == "vllm_hs_fp8",
        "untrained": name == "untrained",
    }


def draft_result(counts: dict[str, Any]) -> dict[str, Any]:
    """A served draft's acceptance rate and mean acceptance length, with the
    engine's counts."""
    drafted = counts["draft_tokens"]
    return {
        "acceptance_rate": counts["accepted"] / drafted if drafted else 0.0,
        "mean_acceptance_length": (
            1 + counts["accepted"] / counts["drafts"] if counts["drafts"] else 1.0
        ),
        **counts,
    }


def acceptance_ratios(results: dict[str, Any]) -> dict[str, float]:
    """The ratios the aims are about, for the ways that ran."""
    ratios = {}
    if "vllm_hs" in results and "hf" in results and results["hf"]["acceptance_rate"]:
        ratios["vllm_hs_over_hf"] = (
            results["vllm_hs"]["acceptance_rate"] / results["hf"]["acceptance_rate"]
        )
    if "vllm_hs_fp8" in results and results.get("vllm_hs", {}).get("acceptance_rate"):
        ratios["fp8_over_vllm_hs"] = (
            results["vllm_hs_fp8"]["acceptance_rate"]
            / results["vllm_hs"]["acceptance_rate"]
        )
    if "hf" in results and "untrained" in results:
        ratios["hf_minus_untrained"] = (
            results["hf"]["acceptance_rate"] - results["untrained"]["acceptance_rate"]
        )
    return ratios


def acceptance_summary(ratios: dict[str, float], metric: str) -> Summary | None:
    """One figure for the generated table (one run: no spread)."""
    if "vllm_hs_over_hf" not in ratios:
        return None
    r = ratios["vllm_hs_over_hf"]
    return Summary(
        metric=metric,
        higher_is_better=True,
        aim=AIMS["vllm_hs_over_hf"],
        median=r,
        min=r,
        max=r,
    )


def aims_met(ratios: dict[str, float]) -> dict[str, dict[str, Any]]:
    return {k: {"aim": v, "met": ratios.get(k, 0.0) >= v} for k, v in AIMS.items()}


def run(settings: AcceptanceSettings) -> dict[str, Any]:
    """Train and serve the drafts `settings.ways`; the result file's keys."""
    names = [n for n in settings.ways.split(",") if n]
    unknown = sorted(set(names) - set(DRAFTS))
    if unknown:
        raise SystemExit(f"unknown ways {unknown}; choose from {DRAFTS}")
    work = Path(settings.work or tempfile.mkdtemp(prefix="hs-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    structured = settings.model is None
    model, data, prompts = prepare_inputs(settings, work)
    settings.layers = model_layers(model)
    config = json.loads((Path(model) / "config.json").read_text())
    dtype = str(config.get("dtype", config.get("torch_dtype", "float32")))
    longest = max(len(p) for p in prompts) + settings.max_new_tokens
    max_model_len = max(256, longest + 2 * settings.num_speculative_tokens + 16)
    seconds: dict[str, float] = {}

    datasets_dir = work / "data"
    needed = {"vllm_hs"} | {n for n in names if n in WAYS}
    for way in ("vllm_hs", "vllm_hs_fp8"):
        if way in needed:
            seconds[f"extract_{way}"] = extract(
                settings, data, datasets_dir / way, way.endswith("fp8"), dtype,
                logs / f"extract-{way}.log",
            )  # fmt: skip
    common = {"model": model, "source": str(datasets_dir / "vllm_hs"),
              "layers": settings.layers, "dtype": dtype,
              "max_model_len": max_model_len}  # fmt: skip
    for way in ("native", "hf"):
        if way in needed:
            start = time.perf_counter()
            run_stage(way, {**common, "out": str(datasets_dir / way)},
                      logs / f"extract-{way}.log")  # fmt: skip
            seconds[f"extract_{way}"] = time.perf_counter() - start

    if "online" in names:
        copy_rows(datasets_dir / "vllm_hs", datasets_dir / "online")
    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        data_name = "vllm_hs" if name == "untrained" else name
        server = None
        if name == "online":
            server = start_server(model, dtype, max_model_len, settings, logs)
        try:
            args = train_args(
                settings, model, datasets_dir / data_name, work / "drafts" / name, name
            )
            args["endpoint"] = server.base_url if server is not None else None
            trained = run_stage("train", args, logs / f"train-{name}.log")
        finally:
            if server is not None:
                server.stop()
        seconds[f"train_{name}"] = time.perf_counter() - start
        start = time.perf_counter()
        counts = run_stage(
            "serve",
            {**common, "draft": trained["checkpoint"], "prompts": prompts,
             "max_new_tokens": settings.max_new_tokens,
             "num_speculative_tokens": settings.num_speculative_tokens},
            logs / f"serve-{name}.log",
        )  # fmt: skip
        seconds[f"serve_{name}"] = time.perf_counter() - start
        results[name] = draft_result(counts)
        print(f"{name}: {results[name]}", flush=True)
    ratios = acceptance_ratios(results)
    if settings.work is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = acceptance_summary(
        ratios, "EAGLE-3 acceptance rate, draft on vllm_hs data / on hf data"
    )
    rates = ", ".join(f"{k} {v['acceptance_rate']:.3f}" for k, v in results.items())
    return {
        "suite": "acceptance",
        "description": (
            "EAGLE-3 drafts trained by speculators (same seed, steps and "
            "hyperparameters) on the same sequences' states from each way, "
            "served by vLLM on held-out prompts (greedy, 3 speculative tokens): "
            f"acceptance rates {rates}. docs/acceptance.md"
        ),
        "summary": summary,
        "drafts": results,
        "ratios": ratios,
        "aims": aims_met(ratios),
        "settings": {
            **asdict(settings),
            # A label for the table; the directory beside it.
            "model": "structured target" if structured else model,
            "model_dir": model,
            "max_model_len": max_model_len,
        },
        "seconds": {**seconds, "total": time.perf_counter() - t0},
    }


def measure(settings: AcceptanceSettings) -> list[Result]:
    data = run(settings)
    print(json.dumps({"drafts": data["drafts"], "ratios": data["ratios"]}, indent=2))
    recorded = {k: v for k, v in data["settings"].items() if k != "work"}
    result = Result(
        suite="acceptance",
        description=data["description"],
        settings=recorded,
        rounds=[],
        summary=data["summary"],
        extra={
            "drafts": data["drafts"],
            "ratios": data["ratios"],
            "aims": data["aims"],
            "stage_seconds": data["seconds"],
        },
    )
    return [result]
