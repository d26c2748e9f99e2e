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

    PYTHONPATH=. python -m benchmarks.acceptance [--model DIR] [--data JSONL]
        [--seed N] [--quick] [--out FILE.json]

Aims: vllm_hs >= 0.97 x hf, vllm_hs_fp8 >= 0.98 x vllm_hs, hf well above
untrained. Results (settings, versions, per-draft counts) go to ``--out``,
default ``benchmarks/results/<release>/acceptance.json``. Every stage runs in
its own process (one engine each); ``--work DIR`` keeps the data and drafts.
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]
WAYS = ("vllm_hs", "vllm_hs_fp8", "native", "hf")
DRAFTS = (*WAYS, "online", "untrained")
SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
AIMS = {"vllm_hs_over_hf": 0.97, "fp8_over_vllm_hs": 0.98}
KV_CACHE_BYTES = 256 << 20
ENGINE_FLAGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))


@dataclass
class Settings:
    model: str | None = None
    data: str | None = None
    seed: int = 0
    train_conversations: int = 1024
    eval_prompts: int = 64
    max_new_tokens: int = 32
    epochs: int = 5
    num_speculative_tokens: int = 3
    total_seq_len: int = 256
    optimizer: str = "adamw"
    lr: float = 3e-3
    layers: list[int] = field(default_factory=list)
    quick: bool = False


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target model directory")
    parser.add_argument("--data", default=None, help="JSONL of conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="about 10 minutes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None, help="keep files here")
    parser.add_argument("--ways", default=",".join(DRAFTS))
    args = parser.parse_args(argv)
    settings = Settings(model=args.model, data=args.data, seed=args.seed)
    if args.quick:
        settings.quick = True
        settings.train_conversations = 512
        settings.eval_prompts = 32
        settings.epochs = 3
    return args, settings


# --- stages (each in its own process) ---------------------------------------


def run_stage(name: str, payload: dict[str, Any], log: Path) -> dict[str, Any]:
    """`python -m benchmarks.acceptance --stage NAME JSON`; its result line."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.acceptance", "--stage", name,
             json.dumps(payload)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600,
        )  # fmt: skip
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("STAGE_RESULT "):
            return json.loads(line.removeprefix("STAGE_RESULT "))
    tail = "\n".join(text.splitlines()[-40:])
    raise RuntimeError(f"stage {name} failed (exit {proc.returncode}):\n{tail}")


def stage_native(payload: dict[str, Any]) -> dict[str, Any]:
    """vLLM's extract_hidden_states connector on the rows of a vllm_hs
    dataset; writes a dataset with the same rows and the connector's states."""
    import datasets
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks.workload import wait_native_files

    out = Path(payload["out"])
    files = out / "native-files"
    llm = _engine(
        payload,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": payload["layers"]}
            },
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(files)},
        },
    )
    rows = datasets.load_from_disk(payload["source"])
    prompts = [
        TokensPrompt(prompt_token_ids=list(map(int, r))) for r in rows["input_ids"]
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    paths = wait_native_files(llm, outs)

    def states(i: int, ids: list[int]) -> Any:
        tensors = load_file(paths[i])
        if tensors["token_ids"].tolist() != ids:
            raise RuntimeError(f"native file {paths[i]} is not row {i}")
        return tensors["hidden_states"]

    written = write_states(Path(payload["source"]), out, states)
    shutil.rmtree(files, ignore_errors=True)
    return {"rows": written}


def stage_hf(payload: dict[str, Any]) -> dict[str, Any]:
    """HF transformers' forward on the rows of a vllm_hs dataset."""
    from vllm_hs.hf_reference import hf_hidden_states

    def states(i: int, ids: list[int]) -> Any:
        return hf_hidden_states(payload["model"], ids, payload["layers"])

    written = write_states(Path(payload["source"]), Path(payload["out"]), states)
    return {"rows": written}


def write_states(source: Path, out: Path, states: Any) -> int:
    """A dataset in `out` with the rows of `source` and, for row i, the
    hidden states `states(i, token ids)`; returns the number of rows."""
    import datasets
    import torch

    from vllm_hs.extract.formats.speculators import hs_path, save_hs_file

    rows = datasets.load_from_disk(str(source))
    copy_rows(source, out)
    for i, (ids, mask) in enumerate(
        zip(rows["input_ids"], rows["loss_mask"], strict=True)
    ):
        ids = list(map(int, ids))
        save_hs_file(
            hs_path(out, i),
            {"hidden_states": states(i, ids).contiguous()},
            torch.tensor(ids, dtype=torch.int64),
            i,
            list(map(int, mask)),
        )
    return len(rows)


def _engine(payload: dict[str, Any], **kwargs: Any) -> Any:
    """An in-process vLLM engine on the target, as every stage runs it."""
    from vllm import LLM

    return LLM(
        model=payload["model"],
        dtype=payload["dtype"],
        max_model_len=payload["max_model_len"],
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
        **kwargs,
    )


def copy_rows(source: Path, out: Path) -> None:
    """The dataset's rows (Arrow files, token_freq.pt), not its states."""
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.startswith("vllm_hs_extract"):
            shutil.copy2(path, out / path.name)
    (out / "hidden_states").mkdir(exist_ok=True)


def stage_train(payload: dict[str, Any]) -> dict[str, Any]:
    """speculators' own trainer (`speculators train`), on CPU."""
    if payload.get("endpoint"):
        # Registers the vllm-hs backend before speculators reads its options.
        import vllm_hs.client.speculators_online  # noqa: F401
    _speculators_on_cpu()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    argv = [
        "--verifier-name-or-path", payload["model"],
        "--data-path", payload["data"],
        "--save-path", payload["save"],
        "--log-dir", payload["save"] + "-logs",
        "--epochs", str(payload["epochs"]),
        "--num-workers", "0",
        "--total-seq-len", str(payload["total_seq_len"]),
        "--train-data-ratio", "0.95",
        "--seed", str(payload["seed"]),
        "--target-layer-ids", *map(str, payload["layers"][:-1]),
        "--ttt-steps", str(payload["num_speculative_tokens"]),
        "--optimizer", payload["optimizer"],
        "--lr", str(payload["lr"]),
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--no-resume-from-checkpoint",
    ]  # fmt: skip
    if payload.get("endpoint"):
        argv += ["--on-missing", "generate", "--hidden-states-backend", "vllm-hs",
                 "--vllm-endpoint", payload["endpoint"]]  # fmt: skip
    else:
        argv += ["--on-missing", "raise"]
    if payload.get("fp8"):
        argv += ["--hidden-states-backend", "fp8"]
    if payload.get("untrained"):
        argv += ["--dry-run"]
    main(TrainConfig.resolve(argv))
    return {"checkpoint": _checkpoint(Path(payload["save"]))}


def _checkpoint(save: Path) -> str:
    """The directory vLLM loads: the last epoch's (or the dry run's)."""
    candidates = [p for p in save.iterdir() if (p / "config.json").is_file()]
    if (save / "config.json").is_file():
        candidates.append(save)
    if not candidates:
        raise RuntimeError(f"no checkpoint under {save}")
    return str(max(candidates, key=lambda p: p.stat().st_mtime))


def _speculators_on_cpu() -> None:
    """speculators 0.9.0's trainer assumes an accelerator in three places:
    the model and batches go to `local_rank` (0), autocast falls back to
    "cuda", and its step timer synchronises the accelerator."""
    import speculators.train.trainer as trainer
    import torch

    trainer.get_local_rank = lambda: "cpu"
    setup = trainer.Trainer.setup_trainer

    def setup_trainer(self: Any) -> Any:
        self.device_type = "cpu"
        return setup(self)

    trainer.Trainer.setup_trainer = setup_trainer
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *args, **kwargs: None


def stage_serve(payload: dict[str, Any]) -> dict[str, Any]:
    """Held-out prompts through vLLM with the draft: the engine's counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_hs.testing.harness import engine_metric

    llm = _engine(
        payload,
        disable_log_stats=False,
        speculative_config={
            "method": "eagle3",
            "model": payload["draft"],
            "num_speculative_tokens": payload["num_speculative_tokens"],
        },
    )
    before = {k: engine_metric(llm, m) for k, m in SPEC_METRICS.items()}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in payload["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=payload["max_new_tokens"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts = {k: engine_metric(llm, m) - before[k] for k, m in SPEC_METRICS.items()}
    counts["generated_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    return counts


STAGES = {
    "native": stage_native,
    "hf": stage_hf,
    "train": stage_train,
    "serve": stage_serve,
}


# --- the suite -------------------------------------------------------------


def prepare_inputs(settings: Settings, work: Path) -> tuple[str, Path, list[list[int]]]:
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
    model: str, dtype: str, max_model_len: int, settings: Settings, logs: Path
) -> Any:
    """A patched `vllm serve` answering every request's prompt states by
    reference in kv_transfer_params (speculators' online mode)."""
    from vllm_hs.testing.server import ServerProcess

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
    settings: Settings, data: Path, out: Path, fp8: bool, dtype: str, log: Path
) -> float:
    cmd = [
        sys.executable, "-m", "vllm_hs.cli", "extract",
        "--model", str(settings.model),
        "--data", str(data),
        "--output", str(out),
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
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"vllm-hs extract failed:\n{tail}")
    return time.perf_counter() - start


def run(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    names = [n for n in args.ways.split(",") if n]
    unknown = sorted(set(names) - set(DRAFTS))
    if unknown:
        raise SystemExit(f"unknown ways {unknown}; choose from {DRAFTS}")
    work = args.work or Path(tempfile.mkdtemp(prefix="hs-acceptance-"))
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
            trained = run_stage(
                "train",
                {
                    "model": model,
                    "data": str(datasets_dir / data_name),
                    "save": str(work / "drafts" / name),
                    "epochs": settings.epochs,
                    "total_seq_len": settings.total_seq_len,
                    "seed": settings.seed,
                    "layers": settings.layers,
                    "num_speculative_tokens": settings.num_speculative_tokens,
                    "optimizer": settings.optimizer,
                    "lr": settings.lr,
                    "fp8": name == "vllm_hs_fp8",
                    "untrained": name == "untrained",
                    "endpoint": server.base_url if server is not None else None,
                },
                logs / f"train-{name}.log",
            )
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
        drafted = counts["draft_tokens"]
        results[name] = {
            "acceptance_rate": counts["accepted"] / drafted if drafted else 0.0,
            "mean_acceptance_length": (
                1 + counts["accepted"] / counts["drafts"] if counts["drafts"] else 1.0
            ),
            **counts,
        }
        print(f"{name}: {results[name]}", flush=True)
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
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = None
    if "vllm_hs_over_hf" in ratios:
        # One figure for the generated table (one run: no spread).
        r = ratios["vllm_hs_over_hf"]
        summary = {
            "metric": "EAGLE-3 acceptance rate, draft on vllm_hs data / on hf data",
            "higher_is_better": True,
            "aim": AIMS["vllm_hs_over_hf"],
            "median": r,
            "min": r,
            "max": r,
        }
    rates = ", ".join(f"{k} {v['acceptance_rate']:.3f}" for k, v in results.items())
    return {
        "suite": "acceptance",
        "description": (
            "EAGLE-3 drafts trained by speculators (same seed, steps and "
            "hyperparameters) on the same sequences' states from each way, "
            "served by vLLM on held-out prompts (greedy, 3 speculative tokens): "
            f"acceptance rates {rates}. docs/acceptance.md"
        ),
        **({"summary": summary} if summary else {}),
        "drafts": results,
        "ratios": ratios,
        "aims": {
            k: {"aim": v, "met": ratios.get(k, 0.0) >= v} for k, v in AIMS.items()
        },
        "settings": {
            **asdict(settings),
            # A label for the table; the directory beside it.
            "model": "structured target" if structured else model,
            "model_dir": model,
            "max_model_len": max_model_len,
        },
        "seconds": {**seconds, "total": time.perf_counter() - t0},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stage"]:
        result = STAGES[argv[1]](json.loads(argv[2]))
        print("STAGE_RESULT " + json.dumps(result), flush=True)
        return 0
    args, settings = parse_args(argv)
    from benchmarks.common import (
        installed_versions,
        machine_facts,
        now,
        write_script_result,
    )

    data = run(args, settings)
    data["versions"] = installed_versions()
    data["machine"] = machine_facts()
    data["started"] = now()
    print(json.dumps({"drafts": data["drafts"], "ratios": data["ratios"]}, indent=2))
    print("->", write_script_result(data, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
