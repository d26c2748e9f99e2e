"""Disk and error of `vllm-hs extract --storage-dtype`: the same extraction
stored in the model's dtype (auto), bfloat16, float16 and speculators' FP8
layout, on one in-process engine; bytes of the hs files, and each stored row
against the model-dtype row (read back as speculators' trainer would: fp8
through hs-connectors' dequantization).

Errors are per element: relative to the element (|stored - exact| / |exact|,
over elements with |exact| >= 1e-3 of their token's largest magnitude), and
relative to the token's largest magnitude (what a per-token scale bounds).

    python -m benchmarks run storage [--model large] [--conversations 100]

Writes benchmarks/results/v<vllm version>/storage.json.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, Summary
from benchmarks.suites.engine import MODELS, require_seeded, seeded_model


@dataclass
class StorageSettings:
    model: str = option("large", "")
    dtype: str = option("float32", "")
    conversations: int = option(100, "")

    def __post_init__(self) -> None:
        require_seeded(self.model)


STORAGES = ("auto", "bfloat16", "float16", "fp8")


def _load_rows(path: Path) -> Any:
    """hidden_states of one hs file as float32 (fp8 dequantized by
    hs-connectors, as speculators' FP8Transfer does)."""
    import torch
    from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    rows = tensors["hidden_states"]
    if SCALES_KEY in tensors:
        return dequantize_fp8_tensor(rows, tensors[SCALES_KEY], dtype=torch.float32)
    return rows.to(torch.float32)


def _errors(stored: list[Any], exact: list[Any]) -> dict[str, float]:
    import torch

    rel_element, rel_token = [], []
    for s, e in zip(stored, exact, strict=True):
        diff = (s - e).abs()
        amax = e.abs().amax(dim=(1, 2), keepdim=True).clamp(min=1e-30)
        rel_token.append((diff / amax).flatten())
        significant = e.abs() >= amax * 1e-3
        rel_element.append((diff[significant] / e.abs()[significant]).flatten())
    token = torch.cat(rel_token)
    element = torch.cat(rel_element)
    return {
        "max_rel_to_token_amax": float(token.max()),
        "mean_rel_to_token_amax": float(token.mean()),
        "max_rel_to_element": float(element.max()),
        "mean_rel_to_element": float(element.mean()),
        "rms_rel_to_element": float(element.pow(2).mean().sqrt()),
    }


def measure(args: StorageSettings) -> list[Result]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM

    from vllm_hs.extract.inputs import load_conversations, shipped_conversations_path
    from vllm_hs.extract.job import extract
    from vllm_hs.extract.settings import ExtractSettings
    from vllm_hs.layer_ids import default_layers

    sizes = MODELS[args.model]
    model = seeded_model(args.model)
    layers = default_layers(sizes.get("num_hidden_layers", 4))
    conversations, sha = load_conversations(shipped_conversations_path())
    conversations = conversations[: args.conversations]
    llm = LLM(
        model,
        hidden_states_config={"layers": layers},
        dtype=args.dtype,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
    )
    work = Path(tempfile.mkdtemp(prefix="vllm-hs-storage-"))
    rows: dict[str, list[Any]] = {}
    sides: dict[str, dict[str, Any]] = {}
    for storage in STORAGES:
        out = work / storage
        settings = ExtractSettings(
            out, layers, sha, storage_dtype=storage, progress=False
        )
        result = extract(llm, conversations, settings)
        files = [
            out / "hidden_states" / f"hs_{i}.safetensors" for i in range(result.samples)
        ]
        rows[storage] = [_load_rows(f) for f in files]
        manifest = json.loads((out / "vllm_hs_extract.json").read_text())
        sides[storage] = {
            "stored_dtype": manifest["dtype"],
            "hs_bytes": sum(f.stat().st_size for f in files),
            "samples": result.samples,
            "tokens": result.tokens,
            "seconds": result.seconds,
        }
        print(f"{storage}: {sides[storage]}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    base = sides["auto"]["hs_bytes"]
    for storage in STORAGES:
        sides[storage]["bytes_over_auto"] = sides[storage]["hs_bytes"] / base
        sides[storage]["errors"] = _errors(rows[storage], rows["auto"])
        print(
            f"{storage}: {sides[storage]['bytes_over_auto']:.3f} of the bytes; "
            f"errors {sides[storage]['errors']}",
            flush=True,
        )
    fp8 = sides["fp8"]["bytes_over_auto"]
    result = Result(
        suite="storage",
        description=(__doc__ or "").split("\n\n")[0],
        settings={
            "model": args.model,
            "dtype": args.dtype,
            "conversations": args.conversations,
            "layers": layers,
            "vllm": vllm.__version__,
        },
        rounds=[{"storage": s, **sides[s]} for s in STORAGES],
        summary=Summary(
            metric=f"hs file bytes with --storage-dtype fp8 / {args.dtype} "
            "(errors per storage dtype in rounds)",
            higher_is_better=False,
            aim=None,
            median=fp8,
            min=fp8,
            max=fp8,
        ),
    )
    return [result]
