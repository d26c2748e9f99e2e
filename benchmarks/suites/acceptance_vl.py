"""The acceptance benchmark (`benchmarks.suites.acceptance`) on a
vision-language target: image prompts.

The default target is `vllm_hs.models.structured_vl` (a tiny Qwen2.5-VL whose
language model is the trained structured target's, with a seeded vision
tower); each conversation's user turn carries one seeded image (an OpenAI
``image_url`` part, ``file://`` URL) before the structured-language text. A
row is the *expanded* sequence (one ``<|image_pad|>`` per image embedding, as
vLLM's ``prompt_token_ids`` and speculators' data have it) and its states
cover every position, image positions included. speculators trains the
EAGLE-3 draft on them as on text (1-D positions, ``embed_tokens`` of the
placeholder at image positions); vLLM serves it on the image prompts
(``{"prompt_token_ids": ..., "multi_modal_data": {"image": ...}}``), feeding
the draft text-only inputs as in training.

Ways:

* ``vllm_hs``: ``vllm-hs extract --regenerate --format speculators`` on the
  image conversations (the target writes the replies);
* ``vllm_hs_fp8``: the same with ``--storage-dtype fp8``, read through
  speculators' ``FP8Transfer``;
* ``hf``: HF transformers' forward, with the images, on the same expanded
  rows (``vllm_hs``'s; without that way, vLLM's greedy replies to the same
  prompts: the ``mm_rows`` stage);
* ``untrained``: speculators' initialised draft, the floor.

    python -m benchmarks run acceptance_vl [--model DIR] [--data JSONL]
        [--seed N] [--quick] [--ways LIST] [--work DIR] [--out RESULTS_ROOT]

``--data`` is a JSONL of ``{"messages": [...]}`` whose user turns carry
``image_url`` parts with ``file://`` URLs; the last ``eval_prompts`` are held
out. Results go to ``<results root>/<release>/acceptance_vl.json``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result
from benchmarks.suites.acceptance import (
    AcceptanceSettings,
    acceptance_ratios,
    acceptance_summary,
    aims_met,
    draft_result,
    extract,
    model_layers,
    train_args,
)
from benchmarks.suites.acceptance_stages import run_stage
from vllm_hs.extract.images import image_urls

DRAFTS = ("vllm_hs", "vllm_hs_fp8", "hf", "untrained")
#: Image tokens of one image at most (`vllm_hs.models.tiny_vl`'s processor).
MAX_IMAGE_TOKENS = 16


@dataclass
class AcceptanceVLSettings(AcceptanceSettings):
    ways: str = option(",".join(DRAFTS), "drafts to train and serve")


def prepare_inputs(
    settings: AcceptanceSettings, work: Path
) -> tuple[str, Path, list[list[int]], list[list[str]], list[list[str]]]:
    """(target, training JSONL, held-out prompt ids (unexpanded), their
    images, the training conversations' images)."""
    from transformers import AutoTokenizer

    if settings.model is None:
        from vllm_hs.models.structured_vl import build_structured_vl_target

        settings.model = str(build_structured_vl_target(seed=settings.seed))
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    if settings.data is None:
        from vllm_hs.models.structured_vl import image_conversations

        images = work / "images"
        train = image_conversations(settings.train_conversations, "train", images)
        heldout = image_conversations(settings.eval_prompts, "heldout", images)
    else:
        lines = Path(settings.data).read_text().splitlines()
        every = [json.loads(line)["messages"] for line in lines if line.strip()]
        heldout = every[-settings.eval_prompts :]
        train = every[: -settings.eval_prompts][: settings.train_conversations]
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in train))
    prompts = []
    for conversation in heldout:
        user = [m for m in conversation if m["role"] != "assistant"][:1]
        ids = tokenizer.apply_chat_template(
            user, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        prompts.append(list(ids))
    return (
        settings.model,
        data,
        prompts,
        [image_urls(c[:1]) for c in heldout],
        [image_urls(c[:1]) for c in train],
    )


def row_images(rows: Path, images: list[list[str]]) -> list[list[str]]:
    """The images of each row of a dataset: by the sample index an hs file
    of vllm-hs records (rows may skip conversations), else row i = input i."""
    from vllm_hs.extract.formats import sample_files
    from vllm_hs.extract.formats.speculators import hs_path

    files = list(rows.glob("hidden_states/hs_*.safetensors"))
    if not files:
        return images
    fmt = sample_files("speculators")
    return [
        images[fmt.read_meta(hs_path(rows, i)).input_index] for i in range(len(files))
    ]


def run(settings: AcceptanceSettings) -> dict[str, Any]:
    """Train and serve the drafts `settings.ways` on image prompts."""
    names = [n for n in settings.ways.split(",") if n]
    unknown = sorted(set(names) - set(DRAFTS))
    if unknown:
        raise SystemExit(f"unknown ways {unknown}; choose from {DRAFTS}")
    if "untrained" in names and not {"vllm_hs", "hf"} & set(names):
        raise SystemExit("untrained reads the vllm_hs or hf dataset: name one")
    work = Path(settings.work or tempfile.mkdtemp(prefix="hs-acceptance-vl-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    structured = settings.model is None
    model, data, prompts, images, train_images = prepare_inputs(settings, work)
    settings.layers = model_layers(model)
    config = json.loads((Path(model) / "config.json").read_text())
    dtype = str(config.get("dtype", config.get("torch_dtype", "float32")))
    longest = max(
        len(p) + MAX_IMAGE_TOKENS * len(i) for p, i in zip(prompts, images, strict=True)
    )
    longest += settings.max_new_tokens
    max_model_len = max(256, longest + 2 * settings.num_speculative_tokens + 16)
    seconds: dict[str, float] = {}
    common = {"model": model, "layers": settings.layers, "dtype": dtype,
              "max_model_len": max_model_len}  # fmt: skip

    datasets_dir = work / "data"
    if "vllm_hs_fp8" in names:
        seconds["extract_vllm_hs_fp8"] = extract(
            settings, data, datasets_dir / "vllm_hs_fp8", True, dtype,
            logs / "extract-vllm_hs_fp8.log",
        )  # fmt: skip
    if "vllm_hs" in names:
        rows = datasets_dir / "vllm_hs"
        seconds["extract_vllm_hs"] = extract(
            settings, data, rows, False, dtype, logs / "extract-vllm_hs.log"
        )
    else:
        rows = datasets_dir / "rows"
        start = time.perf_counter()
        user_turns = [
            json.loads(line)["messages"][:1] for line in data.read_text().splitlines()
        ]
        made = run_stage(
            "mm_rows",
            {**common, "prompts": user_turns, "images": train_images,
             "out": str(rows), "max_new_tokens": settings.max_new_tokens},
            logs / "rows.log",
        )  # fmt: skip
        seconds["rows"] = time.perf_counter() - start
        print(f"rows: {made}", flush=True)
    if "hf" in names:
        start = time.perf_counter()
        run_stage(
            "hf",
            {**common, "source": str(rows), "out": str(datasets_dir / "hf"),
             "images": row_images(rows, train_images)},
            logs / "extract-hf.log",
        )  # fmt: skip
        seconds["extract_hf"] = time.perf_counter() - start

    results: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        if name == "untrained":
            data_dir = datasets_dir / ("vllm_hs" if "vllm_hs" in names else "hf")
        else:
            data_dir = datasets_dir / name
        trained = run_stage(
            "train",
            train_args(settings, model, data_dir, work / "drafts" / name, name),
            logs / f"train-{name}.log",
        )
        seconds[f"train_{name}"] = time.perf_counter() - start
        start = time.perf_counter()
        counts = run_stage(
            "serve",
            {**common, "draft": trained["checkpoint"], "prompts": prompts,
             "images": images, "max_new_tokens": settings.max_new_tokens,
             "num_speculative_tokens": settings.num_speculative_tokens},
            logs / f"serve-{name}.log",
        )  # fmt: skip
        seconds[f"serve_{name}"] = time.perf_counter() - start
        results[name] = draft_result(counts)
        print(f"{name}: {results[name]}", flush=True)
    ratios = acceptance_ratios(results)
    target_info = {}
    info_file = Path(model) / "structured_vl_target.json"
    if info_file.is_file():
        target_info = json.loads(info_file.read_text())
    if settings.work is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = acceptance_summary(
        ratios,
        "EAGLE-3 acceptance rate on image prompts, draft on vllm_hs data / on hf data",
    )
    rates = ", ".join(f"{k} {v['acceptance_rate']:.3f}" for k, v in results.items())
    return {
        "suite": "acceptance_vl",
        "description": (
            "EAGLE-3 drafts trained by speculators on each way's states of "
            "expanded image-prompt sequences (Qwen2.5-VL target), served by "
            "vLLM on held-out image prompts (greedy, 3 speculative tokens): "
            f"acceptance rates {rates}. docs/acceptance.md"
        ),
        "summary": summary,
        "drafts": results,
        "ratios": ratios,
        "aims": aims_met(ratios),
        "target": target_info,
        "settings": {
            **asdict(settings),
            "model": "structured VL target" if structured else model,
            "model_dir": model,
            "max_model_len": max_model_len,
        },
        "seconds": {**seconds, "total": time.perf_counter() - t0},
    }


def measure(settings: AcceptanceSettings) -> list[Result]:
    data = run(settings)
    print(json.dumps({"drafts": data["drafts"], "ratios": data["ratios"]}, indent=2))
    recorded = {k: v for k, v in data["settings"].items() if k != "work"}
    return [
        Result(
            suite="acceptance_vl",
            description=data["description"],
            settings=recorded,
            rounds=[],
            summary=data["summary"],
            extra={
                "drafts": data["drafts"],
                "ratios": data["ratios"],
                "aims": data["aims"],
                "target": data["target"],
                "stage_seconds": data["seconds"],
            },
        )
    ]
