"""vllm-hs extract --regenerate with the real patched engine (in-process, shared by
the module): the model writes the assistant turns, rows equal HF, greedy tokens
are HF's, sampling is reproducible; --chat-template overrides the model's."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from vllm_hs.extract.inputs import render_with_mask
from vllm_hs.extract.records import MANIFEST
from vllm_hs.extract.settings import RegenerateSettings
from vllm_hs.hf_reference import assert_states_close, hf_greedy, hf_hidden_states
from vllm_hs_testing.extract_output import load_output

LAYERS = [1, 2, 3, 4]
NUM = 36  # conversations of the shipped set used here


@pytest.fixture(scope="module")
def conversations(shipped) -> list:
    return shipped[:NUM]


def test_regenerate_states_equal_hf_on_generated_tokens(
    llm, tmp_path, run_extract, model_dir, tokenizer
):
    """The model writes the assistant turns; every row matches HF, and the
    generated tokens are HF's greedy continuation, turn after turn."""
    batch = [
        [{"role": "user", "content": "Tell me a short story about a red cat."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "(replaced by the model)"},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "(replaced too)"},
        ],
        [
            {"role": "user", "content": "why?"},
            {"role": "assistant", "content": "(replaced)"},
            {"role": "user", "content": "answer this one too"},
        ],
    ]
    max_new = 12
    out = tmp_path / "regen"
    result = run_extract(llm, batch, out, regenerate=RegenerateSettings(max_new))
    assert result.samples == 3 and not result.skipped
    data, files = load_output(out)
    for i, conversation in enumerate(batch):
        # Rebuild the sample with HF alone: greedy-generate each turn, put the
        # decoded text back into the conversation, render the next prompt.
        history = list(conversation)
        slots = [j for j, m in enumerate(history) if m["role"] == "assistant"]
        if history[-1]["role"] == "user":
            slots.append(len(history))
        for n, slot in enumerate(slots):
            prompt, mask = render_with_mask(
                tokenizer, history[:slot], add_generation_prompt=True
            )
            generated = hf_greedy(model_dir, prompt, max_new, stop_at_eos=True)
            if n < len(slots) - 1:
                text = tokenizer.decode(generated, skip_special_tokens=True)
                history[slot] = {"role": "assistant", "content": text}
        expected_ids = prompt + generated[:-1]
        expected_mask = mask + [1] * (len(generated) - 1)
        hs = files[i]
        assert hs["token_ids"].tolist() == expected_ids, i
        assert data[i]["input_ids"].tolist() == expected_ids
        assert data[i]["loss_mask"].tolist() == expected_mask
        if len(slots) > 1:
            assert sum(mask) > 0  # earlier (regenerated) turns are supervised
        assert_states_close(
            hs["hidden_states"],
            hf_hidden_states(model_dir, expected_ids, LAYERS),
            dtype=torch.float32,
            what=f"regenerated sample {i}",
            layers=LAYERS,
        )
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["regenerate"] == {
        "max_new_tokens": max_new,
        "temperature": 0.0,
        "seed": 0,
    }


def test_regenerate_with_sampling_is_reproducible(
    llm, conversations, tmp_path, run_extract, model_dir, file_digests
):
    """temperature > 0: conversation n samples with seed --seed + n, so a rerun
    (or a resume) writes the same files; states still equal HF."""
    batch = conversations[:4]
    options = dict(regenerate=RegenerateSettings(8, 1.0, 7))
    first = run_extract(llm, batch, tmp_path / "a", **options)
    second = run_extract(llm, batch, tmp_path / "b", **options)
    assert first.samples == second.samples == 4
    assert file_digests(tmp_path / "a") == file_digests(tmp_path / "b")
    _, files = load_output(tmp_path / "a")
    for i, hs in enumerate(files):
        assert_states_close(
            hs["hidden_states"],
            hf_hidden_states(model_dir, hs["token_ids"].tolist(), LAYERS),
            dtype=torch.float32,
            what=f"sampled sample {i}",
            layers=LAYERS,
        )


def test_chat_template_override(llm, conversations, tmp_path, run_extract, tokenizer):
    """--chat-template: a template without generation markers renders the same
    tokens; the mask then comes from prefix renders (the newline after each
    assistant <|im_end|> counts too) and the manifest records the template."""
    from vllm_hs.models.tiny import CHAT_TEMPLATE

    template = CHAT_TEMPLATE.replace("{%- generation -%}", "").replace(
        "{%- endgeneration -%}", ""
    )
    batch = conversations[:4]
    out = tmp_path / "template"
    run_extract(llm, batch, out, chat_template=template)
    data, files = load_output(out)
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    for i, conversation in enumerate(batch):
        ids, marked = render_with_mask(tokenizer, conversation)
        assert data[i]["input_ids"].tolist() == ids
        mask = data[i]["loss_mask"].tolist()
        assert (
            mask == render_with_mask(tokenizer, conversation, chat_template=template)[1]
        )
        extra = [t for t in range(len(ids)) if mask[t] and not marked[t]]
        assert extra and all(ids[t] == newline for t in extra)
    manifest = json.loads((out / MANIFEST).read_text())
    assert (
        manifest["chat_template_sha256"]
        == hashlib.sha256(template.encode()).hexdigest()
    )
