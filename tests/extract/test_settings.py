"""vllm_hs.extract.settings: what `ExtractSettings` refuses on construction
(before any model or engine), and that it stays as built."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.settings import ExtractSettings, RayOptions, RegenerateSettings


def settings(**fields: Any) -> ExtractSettings:
    fields.setdefault("output", Path("out"))
    fields.setdefault("layers", [1, 2, 3, 4])
    return ExtractSettings(data_sha256="x", **fields)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_shards": 2, "shard_index": 2}, "--shard-index must be in 0..1"),
        ({"num_shards": 0}, "--shard-index must be in 0..-1"),
        ({"max_length": 0}, "--max-length must be positive"),
        ({"storage_dtype": "int8"}, "--storage-dtype must be one of"),
        ({"trainer_format": "eagle"}, "--format must be one of"),
        ({"compress": True}, "--compress is for --format specforge"),
        ({"trainer_format": "modelopt"}, "the last of --layers must be final_norm"),
        (
            {"trainer_format": "specforge", "layers": [1, 2, "final_norm"]},
            "needs exactly 3 aux layers",
        ),
        (
            {
                "trainer_format": "modelopt",
                "layers": [1, 2, "final_norm"],
                "storage_dtype": "fp8",
            },
            "--storage-dtype fp8 is speculators' layout",
        ),
        ({"ray": RayOptions()}, "--ray starts its own engines"),
    ],
)
def test_refused_on_construction(fields: dict[str, Any], message: str):
    with pytest.raises(VllmHsError, match=message):
        settings(**fields)


def test_sub_settings_refuse_what_cannot_run():
    with pytest.raises(VllmHsError, match="--max-new-tokens must be positive"):
        RegenerateSettings(max_new_tokens=0)
    with pytest.raises(VllmHsError, match="--replicas must be at least 1"):
        RayOptions(replicas=0)
    with pytest.raises(VllmHsError, match="--ray-batch-size must be at least 1"):
        RayOptions(batch_size=0)


def test_frozen_normalized_and_picklable():
    built = settings(
        output="o",
        trainer_format="specforge",
        compress=True,
        layers=[2, 3, 4, "final_norm"],
        storage_dtype="bfloat16",
        regenerate=RegenerateSettings(8, 0.5, 7),
    )
    assert built.output == Path("o") and built.layers == (2, 3, 4, "final_norm")
    assert built.files.name == "specforge" and built.files.suffix == ".ckpt.gz"
    assert built.stored_dtype("float32") == "bfloat16"
    assert settings().stored_dtype("float32") == "float32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.resume = True  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(built)) == built
