"""`vllm-hs extract` of conversations with images on the tiny Qwen2.5-VL, in
speculators' VLM data layout: the engine's expanded prompt, every row equal to
HF transformers' forward over the same expanded ids and the same pixels, loss
mask 0 on image positions, and the ``messages`` column that re-renders to the
row. One in-process engine for the module."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hs.extract.formats.speculators import SpeculatorsFiles
from vllm_hs.extract.images import (
    collapse_image_runs,
    expand_loss_mask,
    image_urls,
    load_image,
)
from vllm_hs.extract.inputs import load_conversations, plan_samples, render_with_mask
from vllm_hs.extract.job import extract
from vllm_hs.extract.outdir import scan_finished
from vllm_hs.extract.records import HS_DIR, SkipStage, read_skipped
from vllm_hs.extract.settings import ExtractSettings, RegenerateSettings
from vllm_hs.hf_reference import assert_states_close, hf_hidden_states
from vllm_hs.models.tiny_vl import seeded_image
from vllm_hs_testing.engines import engine
from vllm_hs_testing.extract_output import hs_metadata, load_output

#: The embedding output, the one layer's output (L = 2, before the final norm).
LAYERS = [0, 1, 2]
#: 84x56: 6 image tokens; 56x56: 4.
WIDE, SMALL = (84, 56), (56, 56)


@pytest.fixture(scope="module")
def llm(vl_fp32: str) -> Iterator[Any]:
    with engine(
        vl_fp32,
        "inproc",
        dtype="float32",
        hidden_states_config={"layers": LAYERS},
        limit_mm_per_prompt={"image": 2, "video": 0},
        enforce_eager=True,
    ) as shared:
        yield shared


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JSONL of three conversations: a data-URL image and a file image in two
    user turns; text only; speculators' ShareGPT image part (a relative path)."""
    root = tmp_path_factory.mktemp("vl-data")
    (root / "images").mkdir()
    seeded_image(1, *WIDE).save(root / "images" / "wide.png")
    seeded_image(2, *SMALL).save(root / "small.png")
    small = base64.b64encode((root / "small.png").read_bytes()).decode()
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Look closely."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this? "},
                        {
                            "type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{small}"},
                        },
                    ],
                },
                {"role": "assistant", "content": "A small picture."},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "images/wide.png"}},
                        {"type": "text", "text": "And this one?"},
                    ],
                },
                {"role": "assistant", "content": "A wide one."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Tell me about cats."},
                {"role": "assistant", "content": "They purr."},
            ]
        },
        {
            "conversations": [
                {
                    "from": "human",
                    "value": [
                        {"type": "image", "path": "images/wide.png"},
                        {"type": "text", "text": "Colors?"},
                    ],
                },
                {"from": "gpt", "value": "Many."},
            ]
        },
    ]
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _extract(llm: Any, data: Path, output: Path, **kwargs: Any) -> Any:
    conversations, sha = load_conversations(data)
    settings = ExtractSettings(
        output=output,
        layers=LAYERS,
        data=str(data),
        data_sha256=sha,
        progress=False,
        **kwargs,
    )
    return conversations, extract(llm, conversations, settings)


def _check_rows(states: torch.Tensor, model: str, ids: list[int], images, what: str):
    expected = hf_hidden_states(model, ids, LAYERS, dtype=torch.float32, images=images)
    assert_states_close(states, expected, dtype=torch.float32, what=what, layers=LAYERS)


def _part(part: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in part.items() if v is not None}


def test_images_extract_to_speculators_vlm_data(llm, vl_fp32, data, tmp_path):
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    conversations, result = _extract(llm, data, tmp_path / "out")
    assert (result.samples, result.skipped) == (3, [])
    dataset, files = load_output(tmp_path / "out")
    tokenizer = llm.get_tokenizer()
    pad = llm.llm_engine.model_config.hf_config.image_token_id
    image_counts = [6 + 4, 0, 6]
    for i, (conversation, file) in enumerate(zip(conversations, files, strict=True)):
        ids = dataset[i]["input_ids"].tolist()
        mask = dataset[i]["loss_mask"].tolist()
        assert file["token_ids"].tolist() == ids
        assert ids.count(pad) == image_counts[i]
        rendered, rendered_mask = render_with_mask(tokenizer, conversation)
        assert collapse_image_runs(ids, pad) == rendered
        assert mask == expand_loss_mask(rendered, rendered_mask, ids, pad)
        assert all(m == 0 for t, m in zip(ids, mask, strict=True) if t == pad)
        assert (
            tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
            == {
                0: "A small picture.<|im_end|>A wide one.<|im_end|>",
                1: "They purr.<|im_end|>",
                2: "Many.<|im_end|>",
            }[i]
        )
        images = [load_image(u) for u in image_urls(conversation)]
        _check_rows(file["hidden_states"], vl_fp32, ids, images, f"row {i}")
        # The messages column: OpenAI content lists, file images by absolute
        # file:// URL, the data URL as given; it re-renders to the row.
        # Arrow fills the fields a part lacks with None, as in speculators' own
        # column; vLLM's chat parser (what speculators sends it to) reads a
        # part by its type.
        messages = [
            {**m, "content": [_part(p) for p in m["content"]]}
            for m in dataset.with_format(None)[i]["messages"]
        ]
        urls = [
            p["image_url"]["url"]
            for m in messages
            for p in m["content"]
            if p["type"] == "image_url"
        ]
        assert urls == image_urls(conversation)
        rerendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True
        )["input_ids"]
        assert collapse_image_runs(ids, pad) == list(rerendered)
        assert "messages" in hs_metadata(
            tmp_path / "out" / HS_DIR / f"hs_{i}.safetensors"
        )
    wide = f"file://{(data.parent / 'images' / 'wide.png').resolve()}"
    assert image_urls(conversations[2]) == [wide]
    assert image_urls(conversations[0])[0].startswith("data:image/png;base64,")

    # speculators reads it as it reads its own VLM data.
    loaded = ArrowDataset(
        max_len=512,
        datapath=str(tmp_path / "out"),
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    for i in range(len(loaded)):
        item = loaded[i]
        check_hidden_states(files[i], item["input_ids"].tolist())
        assert torch.equal(
            item["verifier_last_hidden_states"], files[i]["hidden_states"][:, -1]
        )

    # --resume's scan takes every expanded file as the planned sample.
    samples, _ = plan_samples(conversations, tokenizer, max_length=511)
    out = tmp_path / "out"
    found = scan_finished(out, samples, 3, 64, SpeculatorsFiles(), pad)
    assert sorted(found) == [0, 1, 2]
    assert found[0].messages is not None


def test_max_length_applies_after_expansion(llm, data, tmp_path):
    # Conversation 2 fits --max-length as rendered (one placeholder), not once
    # its image is expanded to 6 tokens.
    conversations, _ = load_conversations(data)
    rendered, _ = render_with_mask(llm.get_tokenizer(), conversations[2])
    limit = len(rendered) + 2
    _, result = _extract(llm, data, tmp_path / "out", max_length=limit)
    skips = {s.index: s for s in read_skipped(tmp_path / "out")}
    assert skips[2].stage is SkipStage.PLAN
    assert (
        f"{len(rendered) + 5} tokens after image expansion > --max-length {limit}"
        in (skips[2].reason)
    )
    assert result.rejected == []


def test_regenerate_carries_the_images_across_turns(llm, vl_fp32, data, tmp_path):
    regenerate = RegenerateSettings(max_new_tokens=3)
    conversations, result = _extract(llm, data, tmp_path / "out", regenerate=regenerate)
    assert result.samples == 3, result.skipped
    dataset, files = load_output(tmp_path / "out")
    pad = llm.llm_engine.model_config.hf_config.image_token_id
    ids = dataset[0]["input_ids"].tolist()
    assert ids.count(pad) == 10
    images = [load_image(u) for u in image_urls(conversations[0])]
    _check_rows(files[0]["hidden_states"], vl_fp32, ids, images, "regenerated")
    messages = dataset.with_format(None)[0]["messages"]
    assert [m["role"] for m in messages][-1] == "assistant"
