"""The stages of the acceptance suite (`benchmarks.suites.acceptance`), each
run in its own process (one engine each):

    python -m benchmarks.suites.acceptance_stages NAME '<payload json>'

prints its result on a `STAGE_RESULT ` line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.machine import REPO_ROOT

SPEC_METRICS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
KV_CACHE_BYTES = 256 << 20


def run_stage(name: str, payload: dict[str, Any], log: Path) -> dict[str, Any]:
    """`python -m benchmarks.suites.acceptance_stages NAME JSON`; its result."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.suites.acceptance_stages", name,
             json.dumps(payload)],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600,
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
    """HF transformers' forward on the rows of a vllm_hs dataset (with row
    i's images, `payload["images"][i]`, on a vision-language target)."""
    from vllm_hs.hf_reference import hf_hidden_states

    images = payload.get("images")

    def states(i: int, ids: list[int]) -> Any:
        pictures = load_images(images[i]) if images else ()
        return hf_hidden_states(
            payload["model"], ids, payload["layers"], images=pictures
        )

    written = write_states(Path(payload["source"]), Path(payload["out"]), states)
    return {"rows": written}


def stage_mm_rows(payload: dict[str, Any]) -> dict[str, Any]:
    """The rows of a vision-language dataset: each conversation's user turn
    (its images in `payload["images"][i]`) through vLLM, which expands the
    image placeholders and writes the reply (greedy); row = the engine's
    expanded prompt ids + the reply, loss mask 1 on the reply. The
    `vllm-hs extract --regenerate` rows until its extraction takes images."""
    from array import array

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_hs.extract.dataset import write_arrow, write_token_freq
    from vllm_hs.extract.records import Row

    tokenizer = AutoTokenizer.from_pretrained(payload["model"])
    llm = _engine(payload)
    prompts = []
    for prompt, images in zip(payload["prompts"], payload["images"], strict=True):
        ids = tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        prompts.append(mm_prompt(list(ids), images))
    params = SamplingParams(temperature=0.0, max_tokens=payload["max_new_tokens"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for out in outs:
        prompt_ids = list(out.prompt_token_ids)
        reply = list(out.outputs[0].token_ids)
        rows.append(
            Row(
                array("i", prompt_ids + reply),
                bytes([0] * len(prompt_ids) + [1] * len(reply)),
            )
        )
    target = Path(payload["out"])
    target.mkdir(parents=True, exist_ok=True)
    write_arrow(target, rows)
    write_token_freq(target, rows)
    (target / "hidden_states").mkdir(exist_ok=True)
    image_id = llm.llm_engine.model_config.hf_config.image_token_id
    return {
        "rows": len(rows),
        "image_tokens": sum(r.token_ids.count(image_id) for r in rows),
        "tokens": sum(len(r.token_ids) for r in rows),
    }


def load_images(paths: list[str]) -> list[Any]:
    """PIL images (RGB) from paths or file:// URLs."""
    from PIL import Image

    return [Image.open(p.removeprefix("file://")).convert("RGB") for p in paths]


def mm_prompt(ids: list[int], images: list[str] | None) -> Any:
    """A vLLM prompt: token ids, with their images when there are any."""
    from vllm.inputs import TokensPrompt

    if not images:
        return TokensPrompt(prompt_token_ids=ids)
    pictures = load_images(images)
    return TokensPrompt(
        prompt_token_ids=ids,
        multi_modal_data={"image": pictures if len(pictures) > 1 else pictures[0]},
    )


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

    from vllm_hs_testing.engines import engine_metric

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
    images = payload.get("images") or [None] * len(payload["prompts"])
    prompts = [mm_prompt(p, i) for p, i in zip(payload["prompts"], images, strict=True)]
    params = SamplingParams(temperature=0.0, max_tokens=payload["max_new_tokens"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    counts = {k: engine_metric(llm, m) - before[k] for k, m in SPEC_METRICS.items()}
    counts["generated_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    return counts


STAGES = {
    "native": stage_native,
    "hf": stage_hf,
    "mm_rows": stage_mm_rows,
    "train": stage_train,
    "serve": stage_serve,
}


if __name__ == "__main__":
    stage_result = STAGES[sys.argv[1]](json.loads(sys.argv[2]))
    print("STAGE_RESULT " + json.dumps(stage_result), flush=True)
