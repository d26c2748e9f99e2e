"""vllm-hs extract with the real patched engine (in-process, shared by the module):
states equal HF transformers per sample, speculators' training dataset reads the
output, input forms agree, shards, resume, validation (--regenerate and
--chat-template: test_extract_regenerate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.inputs import load_conversations, render_with_mask
from vllm_hs.extract.outdir import merge_shards, shard_dir
from vllm_hs.extract.records import HS_DIR, MANIFEST, SKIPPED
from vllm_hs.hf_reference import assert_states_close, hf_hidden_states
from vllm_hs_testing.extract_output import hs_metadata, load_output

LAYERS = [1, 2, 3, 4]
NUM = 36  # conversations of the shipped set used here


@pytest.fixture(scope="module")
def conversations(shipped) -> list:
    return shipped[:NUM]


@pytest.fixture(scope="module")
def reference(llm, conversations, tmp_path_factory, run_extract) -> Path:
    """One plain extraction of the conversations, shared by several tests."""
    out = tmp_path_factory.mktemp("reference") / "out"
    result = run_extract(llm, conversations, out)
    assert result.written == result.samples == NUM
    assert not result.skipped
    return out


def test_states_equal_hf_per_sample(reference, conversations, model_dir, tokenizer):
    data, files = load_output(reference)
    assert data.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert data.features["input_ids"].feature.dtype == "int64"
    assert data.features["loss_mask"].feature.dtype == "int64"
    assert data.features["seq_len"].dtype == "int64"
    manifest = json.loads((reference / MANIFEST).read_text())
    assert manifest["complete"] and manifest["samples"] == NUM
    assert manifest["layers"] == LAYERS
    assert manifest["columns"]["3"]["role"] == "verifier_last_hidden_states"
    for i, (row, hs) in enumerate(zip(data, files, strict=True)):
        ids, mask = render_with_mask(tokenizer, conversations[i])
        assert row["input_ids"].dtype == torch.int64
        assert row["input_ids"].tolist() == ids == hs["token_ids"].tolist()
        assert row["loss_mask"].tolist() == mask
        assert int(row["seq_len"]) == len(ids)
        assert hs["token_ids"].dtype == torch.int64
        states = hs["hidden_states"]
        assert states.dtype == torch.float32
        assert tuple(states.shape) == (len(ids), len(LAYERS), 128)
        expected = hf_hidden_states(model_dir, ids, LAYERS)
        assert_states_close(
            states, expected, dtype=torch.float32, what=f"sample {i}", layers=LAYERS
        )
        assert hs_metadata(reference / HS_DIR / f"hs_{i}.safetensors") == {
            "input_index": i,
            "loss_mask": "".join(map(str, mask)),
        }
    assert (reference / SKIPPED).read_text() == ""
    # token_freq.pt: counts of the masked tokens, usable by speculators' mapping.
    from collections import Counter

    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    expected_freq = Counter(
        t
        for row in data
        for t, m in zip(
            row["input_ids"].tolist(), row["loss_mask"].tolist(), strict=True
        )
        if m
    )
    freq = torch.load(reference / "token_freq.pt", weights_only=True)
    assert freq == dict(expected_freq)
    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=freq, draft_vocab_size=64, target_vocab_size=1024
    )
    assert d2t.shape[0] == 64 and t2d.shape[0] == 1024
    assert not [p for p in reference.rglob(".*") if p.name != "."]


def test_speculators_dataset_reads_the_output(reference):
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset, CollateFn

    dataset = ArrowDataset(
        max_len=512,
        datapath=str(reference),
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    assert len(dataset) == NUM
    items = [dataset[i] for i in range(len(dataset))]
    for i, item in enumerate(items):
        t = item["input_ids"].shape[0]
        assert t == dataset.approx_lengths[i]
        assert tuple(item["hidden_states"].shape) == (t, 3 * 128)
        assert tuple(item["verifier_last_hidden_states"].shape) == (t, 128)
        assert tuple(item["loss_mask"].shape) == (t,)
        assert item["lengths"].tolist() == [t]
        from safetensors.torch import load_file

        raw = load_file(str(reference / HS_DIR / f"hs_{i}.safetensors"))
        check_hidden_states(raw, item["input_ids"].tolist())
        # Aux layers 1, 2, 3 side by side; the last column (layer L=4) is the
        # verifier's last hidden state.
        assert torch.equal(
            item["hidden_states"][:, 128:256], raw["hidden_states"][:, 1]
        )
        assert torch.equal(
            item["verifier_last_hidden_states"], raw["hidden_states"][:, 3]
        )
    batch = CollateFn(max_len=512, hidden_size=128, dtype=torch.bfloat16)(items[:4])
    assert tuple(batch["hidden_states"].shape) == (1, 512, 3 * 128)
    assert batch["hidden_states"].dtype == torch.bfloat16
    assert tuple(batch["verifier_last_hidden_states"].shape) == (1, 512, 128)
    assert tuple(batch["document_ids"].shape) == (1, 512)


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_storage_dtype_rounds_the_models_rows(
    storage, llm, conversations, reference, tmp_path, run_extract
):
    out = tmp_path / storage
    result = run_extract(llm, conversations[:12], out, storage_dtype=storage)
    assert result.samples == 12
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["dtype"], manifest["model_dtype"]) == (storage, "float32")
    assert "reading" not in manifest
    _, files = load_output(out)
    _, ref = load_output(reference)
    for i, stored in enumerate(files):
        assert set(stored) == {"hidden_states", "token_ids"}
        expected = ref[i]["hidden_states"].to(getattr(torch, storage))
        assert torch.equal(stored["hidden_states"], expected), f"sample {i}"
        assert torch.equal(stored["token_ids"], ref[i]["token_ids"])


def test_fp8_storage_is_speculators_fp8_layout(
    llm, conversations, reference, tmp_path, run_extract
):
    """Bit for bit what hs-connectors' FP8HiddenStatesConnector writes for the
    same rows; read back through FP8Transfer within fp8's rounding; refused by
    speculators' own check_hidden_states (as the README says)."""
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8
    from hs_connectors.transfer import FP8Transfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    out = tmp_path / "fp8"
    result = run_extract(llm, conversations[:12], out, storage_dtype="fp8")
    assert result.samples == 12
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["dtype"], manifest["model_dtype"]) == ("float8_e4m3fn", "float32")
    assert "FP8Transfer" in manifest["reading"]
    _, files = load_output(out)
    _, ref = load_output(reference)
    for i, stored in enumerate(files):
        assert set(stored) == {"hidden_states", "hidden_states_scales", "token_ids"}
        fp8, scales = quantize_tensor_to_fp8(ref[i]["hidden_states"])
        assert stored["hidden_states"].dtype == torch.float8_e4m3fn
        assert torch.equal(
            stored["hidden_states"].view(torch.uint8), fp8.view(torch.uint8)
        ), f"sample {i}"
        assert stored["hidden_states_scales"].dtype == torch.float32
        assert torch.equal(stored["hidden_states_scales"], scales)
        assert stored["hidden_states_scales"].shape == (len(stored["token_ids"]), 1, 1)
        assert torch.equal(stored["token_ids"], ref[i]["token_ids"])
    dataset = ArrowDataset(
        max_len=512,
        datapath=str(out),
        on_missing="raise",
        hidden_states_dtype=torch.float32,
        transfer=FP8Transfer(out / HS_DIR, dequantize_dtype=torch.float32),
    )
    for i in range(12):
        item = dataset[i]
        rows = ref[i]["hidden_states"]
        scale = files[i]["hidden_states_scales"][:, :, 0]
        # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal steps
        # of 2^-9 times the token's scale.
        tolerance = rows.abs() * 2.0**-4 + scale[:, :, None] * 2.0**-9
        restored = torch.cat(
            [item["hidden_states"], item["verifier_last_hidden_states"]], dim=1
        ).view(rows.shape)
        assert ((restored - rows).abs() <= tolerance).all(), f"sample {i}"
    # speculators 0.9.0: aminmax is not implemented for float8 on the CPU.
    with pytest.raises(NotImplementedError, match="Float8_e4m3fn"):
        check_hidden_states(files[0], files[0]["token_ids"].tolist())


def test_input_forms_give_identical_output(
    llm, conversations, reference, tmp_path, run_extract, write_jsonl, file_digests
):
    from datasets import Dataset

    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    openai = [{"messages": c} for c in conversations]
    sharegpt = [
        {
            "conversations": [
                {"from": roles[m["role"]], "value": m["content"]} for m in c
            ]
        }
        for c in conversations
    ]
    openai_path = write_jsonl(tmp_path / "openai.jsonl", openai)
    sharegpt_path = write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt)
    Dataset.from_list(sharegpt).save_to_disk(str(tmp_path / "saved"))
    expected = file_digests(reference)
    digests = set()
    for source in (openai_path, sharegpt_path, tmp_path / "saved"):
        loaded, sha = load_conversations(source)
        digests.add(sha)
        out = tmp_path / f"out-{source.name}"
        run_extract(llm, loaded, out, data_sha256=sha)
        assert file_digests(out) == expected, source
    assert len(digests) == 1


def test_shards_are_disjoint_complete_and_merge_to_the_whole(
    llm, conversations, reference, tmp_path, run_extract, file_digests
):
    output = tmp_path / "sharded"
    indices = []
    for shard in range(3):
        directory = shard_dir(output, shard, 3)
        result = run_extract(
            llm, conversations, directory, num_shards=3, shard_index=shard
        )
        assert result.samples == len(range(shard, NUM, 3))
        mine = [
            hs_metadata(directory / HS_DIR / f"hs_{i}.safetensors")["input_index"]
            for i in range(result.samples)
        ]
        assert mine == list(range(shard, NUM, 3))
        indices += mine
    assert sorted(indices) == list(range(NUM))
    merged = merge_shards(output)
    assert merged.samples == NUM
    assert file_digests(output) == file_digests(reference)
    data, _ = load_output(output)
    ref_data, _ = load_output(reference)
    assert data.to_dict() == ref_data.to_dict()
    with pytest.raises(VllmHsError, match="already holds a dataset"):
        merge_shards(output)


def test_resume_finishes_an_interrupted_run(
    llm, conversations, reference, tmp_path, run_extract, file_digests
):
    out = tmp_path / "resumed"
    # What a run killed mid-way leaves (the CLI test kills a real one): the
    # manifest it wrote first (complete: false), the hs files finished so far,
    # not necessarily in row order, and temporary files of interrupted writes.
    (out / HS_DIR).mkdir(parents=True)
    manifest = json.loads((reference / MANIFEST).read_text())
    for key in ("samples", "tokens", "bytes", "skipped", "rejected"):
        del manifest[key]
    manifest["complete"] = False
    (out / MANIFEST).write_text(json.dumps(manifest))
    finished = [*range(10), 13, 17]
    for row in finished:
        name = f"hs_{row}.safetensors"
        (out / HS_DIR / name).write_bytes((reference / HS_DIR / name).read_bytes())
    done = len(finished)
    # Leftovers of a crash in the middle of a write: our temp name, and the one
    # safetensors writes before its own rename.
    (out / HS_DIR / ".hs_30.safetensors.Ab12Cd").write_bytes(b"partial")
    (out / HS_DIR / ".tmpAb12Cd").write_bytes(b"partial")
    (out / f".{MANIFEST}.Xy34Zw").write_bytes(b"partial")
    with pytest.raises(VllmHsError, match="pass --resume"):
        run_extract(llm, conversations, out)
    with pytest.raises(VllmHsError, match="other settings.*layers"):
        run_extract(llm, conversations, out, layers=[1, 4], resume=True)
    result = run_extract(llm, conversations, out, resume=True)
    assert result.written == NUM - done
    assert result.samples == NUM
    assert file_digests(out) == file_digests(reference)
    assert not list(out.rglob(".*"))
    again = run_extract(llm, conversations, out, resume=True)
    assert again.already_complete and again.written == 0


def test_a_dead_writers_temp_file_is_not_left_in_the_dataset(
    llm, conversations, reference, tmp_path, run_extract, file_digests, monkeypatch
):
    """A writer killed mid-write while the run goes on (a Ray replica: Ray Data
    restarts it and another replica redoes its batch) leaves its temporary file;
    the completed dataset must not hold it."""
    from vllm_hs.extract import job

    real_run_samples = job.run_samples
    leftover = f".hs_3.safetensors.{2**22 + 1}-140049679984320.tmp"

    def run_samples_while_a_peer_dies(engine, tokenizer, loop, *args, **kwargs):
        real_run_samples(engine, tokenizer, loop, *args, **kwargs)
        (loop.settings.output / HS_DIR / leftover).write_bytes(b"partial")

    monkeypatch.setattr(job, "run_samples", run_samples_while_a_peer_dies)
    out = tmp_path / "out"
    run_extract(llm, conversations, out)
    assert not list(out.rglob(".*"))
    assert file_digests(out) == file_digests(reference)


def test_long_and_empty_conversations_are_skipped_and_reported(
    llm, conversations, tmp_path, run_extract, tokenizer
):
    lengths = [len(render_with_mask(tokenizer, c)[0]) for c in conversations[:6]]
    limit = sorted(lengths)[3]
    no_reply = [{"role": "user", "content": "anyone there?"}]
    batch = [*conversations[:6], no_reply]
    out = tmp_path / "skips"
    result = run_extract(llm, batch, out, max_length=limit)
    too_long = [i for i, n in enumerate(lengths) if n > limit]
    assert too_long
    skipped = [json.loads(x) for x in (out / SKIPPED).read_text().splitlines()]
    assert [s["index"] for s in skipped] == sorted([*too_long, 6])
    for s in skipped:
        assert s["stage"] == "plan"
        if s["index"] in too_long:
            assert f"{lengths[s['index']]} tokens > --max-length {limit}" in s["reason"]
        else:
            assert "no assistant tokens" in s["reason"]
    data, files = load_output(out)
    kept = [i for i in range(6) if i not in too_long]
    assert result.samples == len(data) == len(kept)
    for row, index in enumerate(kept):
        meta = hs_metadata(out / HS_DIR / f"hs_{row}.safetensors")
        assert meta["input_index"] == index
        assert (
            files[row]["token_ids"].tolist()
            == render_with_mask(tokenizer, batch[index])[0]
        )
    with pytest.raises(VllmHsError, match="max_model_len 1024"):
        run_extract(llm, batch, tmp_path / "x", max_length=5000)


def test_bad_states_are_rejected_never_written(
    llm, conversations, tmp_path, run_extract, monkeypatch, tokenizer
):
    """Corrupt what the engine returns for two requests (a NaN, a missing row):
    both samples are reported and skipped, the rest is renumbered densely."""
    engine = llm.llm_engine
    real_step = engine.step

    def corrupting_step():
        outputs = real_step()
        for out in outputs:
            states = out.prompt_hidden_states
            if out.request_id.startswith("vllm-hs-extract-2-"):
                states = states.clone()
                states[5, 1, 7] = float("nan")
                out.prompt_hidden_states = states
            elif out.request_id.startswith("vllm-hs-extract-4-"):
                out.prompt_hidden_states = states[:-1]
        return outputs

    monkeypatch.setattr(engine, "step", corrupting_step)
    out = tmp_path / "bad"
    result = run_extract(llm, conversations[:8], out)
    monkeypatch.undo()
    reasons = {s.index: s.reason for s in result.rejected}
    assert set(reasons) == {2, 4}
    assert "non-finite hidden states (first at row 5, column 1)" in reasons[2]
    rows, tokens = reasons[4].split(" hidden-state rows for ")
    assert int(rows) + 1 == int(tokens.split()[0])
    data, files = load_output(out)
    assert len(data) == result.samples == 6
    for row, index in enumerate([0, 1, 3, 5, 6, 7]):
        assert hs_metadata(out / HS_DIR / f"hs_{row}.safetensors")["input_index"] == (
            index
        )
        ids = render_with_mask(tokenizer, conversations[index])[0]
        assert (
            files[row]["token_ids"].tolist() == ids == data[row]["input_ids"].tolist()
        )
        assert torch.isfinite(files[row]["hidden_states"]).all()
    skipped = [json.loads(x) for x in (out / SKIPPED).read_text().splitlines()]
    assert [(s["index"], s["stage"]) for s in skipped] == [
        (2, "validate"),
        (4, "validate"),
    ]
    assert not list(out.rglob(".*"))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rejected"] == 2 and manifest["samples"] == 6
