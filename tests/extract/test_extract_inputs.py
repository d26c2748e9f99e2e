"""vllm-hs extract without an engine: reading conversations, loss masks checked
against hand-derived renderings, planning, layer ids, the shipped data set."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.images import collapse_image_runs, expand_loss_mask
from vllm_hs.extract.inputs import (
    ConversationError,
    LossMaskError,
    has_generation_markers,
    load_conversations,
    normalize_conversation,
    plan_samples,
    regenerate_slots,
    render_with_mask,
    shipped_conversations_path,
)
from vllm_hs.layer_ids import default_layers, parse_layers
from vllm_hs.models.tiny import CHAT_TEMPLATE

OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hi, how are you?"},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "two "},
                    {"type": "text", "text": "parts"},
                ],
            },  # noqa: E501
            {"role": "assistant", "content": "ok"},
        ]
    },
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "hello there"},
            {"from": "gpt", "value": "hi, how are you?"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "two parts"},
            {"from": "gpt", "value": "ok"},
        ]
    },
]

# ---------------------------------------------------------------------------
# Reading conversations


def test_openai_and_sharegpt_jsonl_normalize_alike(tmp_path: Path, write_jsonl):
    a, sha_a = load_conversations(write_jsonl(tmp_path / "a.jsonl", OPENAI))
    b, sha_b = load_conversations(write_jsonl(tmp_path / "b.jsonl", SHAREGPT))
    assert a == b
    assert sha_a == sha_b
    assert a[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi, how are you?"},
    ]
    assert a[1][0] == {"role": "user", "content": "two parts"}


def test_blank_lines_are_ignored(tmp_path: Path):
    path = tmp_path / "c.jsonl"
    path.write_text("\n" + json.dumps(OPENAI[0]) + "\n\n   \n")
    assert len(load_conversations(path)[0]) == 1


def test_saved_datasets_directory(tmp_path: Path, need_datasets):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(SHAREGPT).save_to_disk(str(tmp_path / "sharegpt"))
    Dataset.from_list([{"messages": OPENAI[0]["messages"], "id": "x"}]).save_to_disk(
        str(tmp_path / "openai")
    )
    expected = load_conversations(shipped_conversations_path())  # smoke
    assert expected[0]
    a, _ = load_conversations(tmp_path / "sharegpt")
    b, _ = load_conversations(tmp_path / "openai")
    assert a[0] == b[0] == normalize_conversation(OPENAI[0], "x")
    DatasetDict({"train": Dataset.from_list(SHAREGPT)}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(ConversationError, match="several splits.*train"):
        load_conversations(tmp_path / "dict")
    Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "text"))
    with pytest.raises(ConversationError, match="no 'messages' or 'conversations'"):
        load_conversations(tmp_path / "text")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:2: invalid JSON"),
        ('{"prompt": "x"}', r"bad\.jsonl:2: no 'messages' \(OpenAI\)"),
        ('{"messages": []}', r"bad\.jsonl:2: .*non-empty list"),
        (
            '{"messages": [{"role": "robot", "content": "x"}]}',
            r"bad\.jsonl:2: turn 0: unknown role 'robot'",
        ),
        (
            '{"conversations": [{"from": "bot", "value": "x"}]}',
            r"bad\.jsonl:2: turn 0: unknown 'from' 'bot'",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
            r"bad\.jsonl:2: turn 0: content part 'input_audio' is not supported",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            r"bad\.jsonl:2: turn 0: image_url part without a URL or path",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image", '
            '"image": "x"}]}]}',
            r"bad\.jsonl:2: turn 0: image part with keys \['image'\]: give 'path'",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url", '
            '"image_url": {"url": "https://example.com/a.png"}}]}]}',
            r"bad\.jsonl:2: turn 0: https://example.com/a.png: only data:image/",
        ),
        ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: turn 0: no 'content'"),
        ("[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path: Path, line: str, message: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(OPENAI[0]) + "\n" + line + "\n")
    with pytest.raises(ConversationError, match=message):
        load_conversations(path)


def test_missing_input(tmp_path: Path):
    with pytest.raises(ConversationError, match="no such file"):
        load_conversations(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------------------
# Loss masks, against renderings derived by hand from the ChatML template:
# every message is '<|im_start|>{role}\n{content}<|im_end|>\n'; with generation
# markers the assistant content and its <|im_end|> are 1, the header and the
# newline after <|im_end|> are 0. Each expected segment is tokenized on its own;
# segments end at special tokens or newlines, which the byte-level tokenizer
# never merges across (checked: the segments concatenate to the full render).

HEADER_A = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"  # noqa: E501
CONV_A = OPENAI[0]["messages"]
CONV_B = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "\nIt is 4.\nSure."},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "ok"},
]
CONV_C = [{"role": "user", "content": "hi"}]

#: (conversation, add_generation_prompt, [(text, mask with markers, mask with
#: prefix renders)])
CASES = {
    "system-user-assistant": (
        CONV_A,
        False,
        [(HEADER_A, 0, 0), ("hi, how are you?<|im_end|>", 1, 1), ("\n", 0, 1)],
    ),
    "two-turns-newlines": (
        CONV_B,
        False,
        [
            ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0, 0),
            ("\nIt is 4.\nSure.<|im_end|>", 1, 1),
            ("\n", 0, 1),
            ("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n", 0, 0),
            ("ok<|im_end|>", 1, 1),
            ("\n", 0, 1),
        ],
    ),
    "generation-prompt": (
        CONV_C,
        True,
        [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0, 0)],
    ),
}


def _expected(tokenizer, segments, column):
    ids, mask = [], []
    for segment in segments:
        piece = tokenizer(segment[0], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [segment[column]] * len(piece)
    return ids, mask


def no_marker_template() -> str:
    template = CHAT_TEMPLATE.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    assert template != CHAT_TEMPLATE and "generation -%}" not in template
    return template


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_from_generation_markers(tokenizer, case: str):
    conversation, prompt, segments = CASES[case]
    assert has_generation_markers(tokenizer.chat_template)
    ids, mask = render_with_mask(tokenizer, conversation, add_generation_prompt=prompt)
    expected_ids, expected_mask = _expected(tokenizer, segments, 1)
    assert ids == expected_ids
    assert mask == expected_mask


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_from_prefix_renders(tokenizer, case: str):
    conversation, prompt, segments = CASES[case]
    template = no_marker_template()
    assert not has_generation_markers(template)
    ids, mask = render_with_mask(
        tokenizer, conversation, add_generation_prompt=prompt, chat_template=template
    )
    expected_ids, expected_mask = _expected(tokenizer, segments, 2)
    assert ids == expected_ids
    assert mask == expected_mask


def test_literal_tokens_of_one_rendering(tokenizer):
    """One rendering spelled out token by token (read off the template)."""
    ids, mask = render_with_mask(
        tokenizer,
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
    )
    pieces = [tokenizer.decode([t]) for t in ids]
    marked = "".join(p for p, m in zip(pieces, mask, strict=True) if m)
    assert "".join(pieces) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    )
    assert marked == "ok<|im_end|>"
    assert pieces[-1] == "\n" and mask[-1] == 0
    assert pieces[-2] == "<|im_end|>" and mask[-2] == 1


def test_both_mask_methods_agree_on_the_shipped_set(tokenizer, shipped):
    """On all 300 shipped conversations the prefix-render mask equals the marker
    mask plus the newline after each assistant <|im_end|>."""
    template = no_marker_template()
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for conversation in shipped:
        ids, marked = render_with_mask(tokenizer, conversation)
        ids2, prefix = render_with_mask(tokenizer, conversation, chat_template=template)
        assert ids == ids2
        glue = [
            1 if t > 0 and marked[t - 1] and ids[t - 1] == im_end else 0
            for t in range(len(ids))
        ]
        assert prefix == [max(m, g) for m, g in zip(marked, glue, strict=True)]
        assert sum(marked) > 0


def test_template_that_is_not_prefix_stable_is_refused(tokenizer):
    # Ends the conversation's last message with <|eos|>: rendering a prefix puts
    # it after an earlier assistant turn, the full render does not.
    template = no_marker_template().replace(
        "{{- '\\n' -}}", "{{- '<|eos|>' if loop.last else '\\n' -}}"
    )
    assert template != no_marker_template()
    single = CONV_A
    ids, mask = render_with_mask(tokenizer, single, chat_template=template)
    assert sum(mask) > 0
    with pytest.raises(LossMaskError, match="not prefix-stable at assistant message 1"):
        render_with_mask(tokenizer, CONV_B, chat_template=template)


def test_no_template_is_refused(tokenizer):
    with pytest.raises(LossMaskError, match="no chat template"):
        render_with_mask(tokenizer, CONV_A, chat_template="")


# ---------------------------------------------------------------------------
# Planning, layers


def test_plan_skips_long_and_unsupervised_and_shards(tokenizer):
    conversations = [
        CONV_A,
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [
            {"role": "user", "content": "word " * 100},
            {"role": "assistant", "content": "x"},
        ],  # noqa: E501
        CONV_B,
        CONV_C,
    ]
    samples, skipped = plan_samples(conversations, tokenizer, max_length=60)
    assert [s.index for s in samples] == [0, 3]
    assert [s.row for s in samples] == [0, 1]
    reasons = {s.index: s.reason for s in skipped}
    assert set(reasons) == {1, 2, 4}
    assert "no assistant tokens" in reasons[1]
    assert "> --max-length 60 (not truncated)" in reasons[2]
    for sample in samples:
        assert (list(sample.input_ids), list(sample.loss_mask)) == render_with_mask(
            tokenizer, conversations[sample.index]
        )
    seen = []
    for shard in range(3):
        part, part_skipped = plan_samples(
            conversations, tokenizer, max_length=1000, num_shards=3, shard_index=shard
        )
        indices = [s.index for s in part] + [s.index for s in part_skipped]
        assert all(i % 3 == shard for i in indices)
        assert [s.row for s in part] == list(range(len(part)))
        seen += indices
    assert sorted(seen) == list(range(len(conversations)))


def test_regenerate_slots_and_plan(tokenizer):
    assert regenerate_slots(CONV_A) == [2]
    assert regenerate_slots(CONV_B) == [1, 3]
    assert regenerate_slots(CONV_C) == [1]
    assert regenerate_slots(CONV_B[:3]) == [1, 3]
    assert regenerate_slots([{"role": "system", "content": "s"}]) == []
    samples, skipped = plan_samples(
        [CONV_B, [{"role": "system", "content": "s"}]],
        tokenizer,
        max_length=100,
        regenerate=True,
    )
    assert len(samples) == 1 and samples[0].slots == [1, 3]
    assert (list(samples[0].input_ids), list(samples[0].loss_mask)) == render_with_mask(
        tokenizer, CONV_B[:1], add_generation_prompt=True
    )
    assert "nothing to regenerate" in skipped[0].reason


def test_default_layers():
    assert default_layers(32) == [2, 16, 29, 32]
    assert default_layers(80) == [2, 40, 77, 80]
    assert default_layers(8) == [2, 4, 5, 8]
    assert default_layers(4) == [1, 2, 3, 4]
    assert default_layers(5) == [1, 2, 4, 5]
    assert default_layers(2) == [1, 2]


def test_parse_layers():
    assert parse_layers(None, 32) == [2, 16, 29, 32]
    assert parse_layers("2, 16,29,-1", 32) == [2, 16, 29, 32]
    assert parse_layers("0,final_norm", 4) == [0, "final_norm"]
    with pytest.raises(VllmHsError, match="layer 99 does not exist.*4 decoder layers"):
        parse_layers("1,99", 4)
    with pytest.raises(VllmHsError, match="'x' is not a layer id"):
        parse_layers("1,x", 4)
    with pytest.raises(VllmHsError, match="duplicate"):
        parse_layers("4,-1", 4)
    with pytest.raises(VllmHsError, match="at least 2 layers"):
        parse_layers("4", 4)


# ---------------------------------------------------------------------------
# The shipped conversation set


def test_shipped_set_is_what_the_script_writes(tmp_path: Path):
    script = shipped_conversations_path().with_name("make_conversations.py")
    out = tmp_path / "conversations.jsonl"
    subprocess.run([sys.executable, str(script), str(out)], check=True)
    assert out.read_bytes() == shipped_conversations_path().read_bytes()
    size = out.stat().st_size
    assert 4_000 < size < 200_000, size


def test_shipped_set_is_openai_form(shipped):
    rows = [
        json.loads(line)
        for line in shipped_conversations_path().read_text().splitlines()
    ]
    assert len(rows) == len(shipped) == 300
    assert all(set(row) == {"messages"} for row in rows)
    turns = [sum(m["role"] == "assistant" for m in c) for c in shipped]
    assert set(turns) == {1, 2, 3}
    assert any(c[0]["role"] == "system" for c in shipped)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_non_finite_scan(dtype: str):
    import torch

    from vllm_hs.extract.writer import _first_non_finite

    states = torch.randn(6, 4, 16).to(getattr(torch, dtype))
    info = torch.finfo(states.dtype)
    states[0, 0, 0], states[1, 1, 1], states[2, 2, 2] = info.max, -info.max, info.tiny
    assert _first_non_finite(states) is None
    # Finite values whose sum overflows: the quick summing pass must not decide.
    assert _first_non_finite(torch.full_like(states, info.max / 2)) is None
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = states.clone()
        bad[5, 0, 3] = value
        bad[3, 2, 15] = value
        assert _first_non_finite(bad) == (3, 2)


# ---------------------------------------------------------------------------
# The manifest and skip records (manifest.py, records.py)


def test_manifest_json_keys_and_round_trip(tmp_path: Path):
    from vllm_hs.extract.manifest import FINGERPRINT_KEYS, Manifest
    from vllm_hs.extract.records import ExtractResult, Skip, SkipStage
    from vllm_hs.extract.settings import RegenerateSettings

    manifest = Manifest(
        model="m",
        model_config_sha256="a",
        data_sha256="b",
        chat_template_sha256="c",
        layers=[1, 2, 3, 4],
        columns={},
        num_hidden_layers=4,
        dtype="float32",
        hidden_size=128,
        max_length=1023,
        regenerate=None,
        validate=True,
    )
    started = {
        "format_version", "format", "model", "model_config_sha256", "data_sha256",
        "chat_template_sha256", "layers", "columns", "num_hidden_layers", "dtype",
        "hidden_size", "max_length", "regenerate", "validate", "num_shards",
        "shard_index", "complete", "trainer_format", "compress",
    }  # fmt: skip
    assert set(manifest.to_json()) == started
    assert manifest.to_json()["regenerate"] is None
    assert (manifest.trainer_format, manifest.compress) == ("speculators", False)
    assert set(FINGERPRINT_KEYS) <= started
    result = ExtractResult(tmp_path, samples=2, tokens=9, bytes=99)
    result.skipped = [Skip(3, "bad", SkipStage.VALIDATE), Skip(1, "long")]
    manifest.summarize(result)
    manifest.regenerate = RegenerateSettings(8, 0.5, 7)
    manifest.write(tmp_path / "m.json")
    value = json.loads((tmp_path / "m.json").read_text())
    assert set(value) == started | {"samples", "tokens", "bytes", "skipped", "rejected"}
    assert (value["complete"], value["skipped"], value["rejected"]) == (True, 2, 1)
    assert value["regenerate"] == {"max_new_tokens": 8, "temperature": 0.5, "seed": 7}
    again = Manifest.read(tmp_path / "m.json")
    assert again == manifest and not again.differences(manifest)
    again.layers = [1, 4]
    assert [k for k, _, _ in again.differences(manifest)] == ["layers"]
    assert Skip(1, "long").to_json() == {"index": 1, "reason": "long", "stage": "plan"}
    assert json.dumps(Skip(3, "x", SkipStage.GENERATE).to_json()) == (
        '{"index": 3, "reason": "x", "stage": "generate"}'
    )
    with pytest.raises(VllmHsError, match="not a vllm-hs extract manifest"):
        Manifest.from_json({"model": "m"}, tmp_path / "m.json")


# ---------------------------------------------------------------------------
# Images in conversations


def _png(path: Path, seed: int, size: tuple[int, int] = (56, 56)) -> Path:
    from vllm_hs.models.tiny_vl import seeded_image

    seeded_image(seed, *size).save(path, format="PNG")
    return path


def _data_url(path: Path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _image_rows(tmp_path: Path) -> list[dict]:
    """One conversation per accepted image form (images/a.png, images/b.png)."""
    (tmp_path / "images").mkdir(exist_ok=True)
    a = _png(tmp_path / "images" / "a.png", 1)
    b = _png(tmp_path / "images" / "b.png", 2)
    answer = {"role": "assistant", "content": "ok"}

    def user(*parts: dict) -> dict:
        return {"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}

    def openai(url: str) -> dict:
        return {
            "messages": [user({"type": "image_url", "image_url": {"url": url}}), answer]
        }

    return [
        openai(_data_url(a)),
        openai(f"file://{a}"),
        openai("images/a.png"),
        openai(str(b)),
        {
            "conversations": [
                {"from": "human", "value": [{"type": "image", "path": "images/b.png"}]},
                {"from": "gpt", "value": "ok"},
            ]
        },
        {"messages": [user({"type": "image", "url": f"file://{b}"}), answer]},
    ]


def test_image_parts_of_every_form_become_openai_parts(tmp_path: Path, write_jsonl):
    rows = _image_rows(tmp_path)
    conversations, _ = load_conversations(write_jsonl(tmp_path / "d.jsonl", rows))
    a, b = (f"file://{(tmp_path / 'images' / n).resolve()}" for n in ("a.png", "b.png"))
    urls = [c[0]["content"][0]["image_url"]["url"] for c in conversations]
    assert urls == [
        rows[0]["messages"][0]["content"][0]["image_url"]["url"],
        a,
        a,
        b,
        b,
        b,
    ]
    assert conversations[1] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": a}},
                {"type": "text", "text": "?"},
            ],
        },
        {"role": "assistant", "content": "ok"},
    ]
    # A ShareGPT turn of one image part stays a part list.
    assert conversations[4][0]["content"] == [
        {"type": "image_url", "image_url": {"url": b}}
    ]


def test_images_count_in_the_input_sha256(tmp_path: Path, write_jsonl):
    rows = _image_rows(tmp_path)[1:2]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    _, before = load_conversations(path)
    _png(tmp_path / "images" / "a.png", 3)  # same path, other pixels
    _, after = load_conversations(path)
    assert before != after
    text = write_jsonl(tmp_path / "t.jsonl", OPENAI)
    conversations, digest = load_conversations(text)
    # Text-only input: the digest is what it was before images were accepted.
    expected = hashlib.sha256()
    for conversation in conversations:
        expected.update(json.dumps(conversation, sort_keys=True).encode() + b"\n")
    assert digest == expected.hexdigest()


@pytest.mark.parametrize("broken", ["missing", "not an image"])
def test_missing_or_unreadable_image_names_file_line_and_image(
    tmp_path: Path, write_jsonl, broken: str
):
    image = tmp_path / "gone.png"
    if broken == "not an image":
        image.write_text("not a png")
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "path": "gone.png"}]}
        ]
    }
    path = write_jsonl(tmp_path / "d.jsonl", [OPENAI[0], row])
    with pytest.raises(ConversationError, match=r"d\.jsonl:2: image .*gone\.png"):
        load_conversations(path)


def test_the_template_sees_image_parts_as_images(tmp_path: Path, write_jsonl):
    from transformers import AutoTokenizer

    from vllm_hs.models.tiny_vl import IMAGE_TOKEN, build_tiny_vl_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_vl_model("float32"))
    rows = _image_rows(tmp_path)[3:4]
    conversations, _ = load_conversations(write_jsonl(tmp_path / "d.jsonl", rows))
    ids, mask = render_with_mask(tokenizer, conversations[0])
    pad = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert ids.count(pad) == 1
    text = tokenizer.decode(ids)
    assert "<|vision_start|><|image_pad|><|vision_end|>?" in text
    masked = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tokenizer.decode(masked) == "ok<|im_end|>"


def test_expanded_prompt_collapses_back_and_widens_the_mask():
    pad = 7
    ids, mask = [1, 5, pad, 6, 2, pad, 3], [0, 0, 0, 0, 1, 0, 1]
    expanded = [1, 5, pad, pad, pad, 6, 2, pad, pad, 3]
    assert collapse_image_runs(expanded, pad) == ids
    assert expand_loss_mask(ids, mask, expanded, pad) == [0, 0, 0, 0, 0, 0, 1, 0, 0, 1]
    assert expand_loss_mask(ids, mask, [1, 5, pad, 6, 2, 3], pad) is None
    assert expand_loss_mask(ids, mask, [1, 5, pad, 6, 9, pad, 3], pad) is None


def test_formats_that_cannot_carry_images_refuse_them():
    from vllm_hs.extract.formats import sample_files

    sample_files("speculators").check_images()
    for name, why in (
        ("specforge", "SpecForge's offline reader"),
        ("modelopt", "online only"),
    ):
        with pytest.raises(VllmHsError, match=f"--format {name} cannot carry: .*{why}"):
            sample_files(name).check_images()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--format", "modelopt"],
            "--data holds images, which --format modelopt cannot",
        ),
        (["--data", "missing.jsonl"], "missing.jsonl:1: image "),
    ],
)
def test_images_are_refused_before_any_model_loads(
    tmp_path: Path, write_jsonl, args: list[str], message: str
):
    rows = _image_rows(tmp_path)[3:4]
    write_jsonl(tmp_path / "d.jsonl", rows)
    gone = {
        "messages": [{"role": "user", "content": [{"type": "image", "path": "x.png"}]}]
    }
    write_jsonl(tmp_path / "missing.jsonl", [gone])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_hs",
            "extract",
            "--data",
            "d.jsonl",
            "--output",
            "out",
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert message in proc.stderr
    assert "vllm" not in proc.stderr.lower().replace("vllm-hs", "")
    assert not (tmp_path / "out").exists()
