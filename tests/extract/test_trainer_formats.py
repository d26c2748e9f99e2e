"""vllm-hs extract --format specforge | modelopt with the real patched engine:
each trainer's own offline reader (SpecForge 0.2.0, ModelOpt 0.47.0) reads the
files back, and every row it hands to training equals HF transformers' row of
that layer and position; shards merge and an interrupted run resumes to the
same files; what the trainers cannot read is refused before any work."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_hs.errors import VllmHsError
from vllm_hs.extract.formats.specforge import SpecForgeFiles
from vllm_hs.extract.inputs import render_with_mask
from vllm_hs.extract.outdir import merge_shards, shard_dir
from vllm_hs.extract.records import HS_DIR, MANIFEST
from vllm_hs.hf_reference import assert_states_close, hf_hidden_states

# Tiny model (L=4): trainer aux ids [0, 1, 2] = vllm-hs [1, 2, 3], then the
# LM head's input.
AUX = [1, 2, 3]
LAYERS = [*AUX, "final_norm"]
NUM = 12
HIDDEN = 128


@pytest.fixture(scope="module")
def conversations(shipped) -> list:
    return shipped[:NUM]


@pytest.fixture(scope="module")
def llm(model_dir: str, inproc_engine):
    with inproc_engine(model_dir, hidden_states_config={"layers": LAYERS}) as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(model_dir, tokenizer, conversations) -> list[dict[str, Any]]:
    """Per conversation: token ids, loss mask, HF's aux rows [T, 3H] and
    final-norm rows [T, H] (float32, like the engine)."""
    out = []
    for conversation in conversations:
        ids, mask = render_with_mask(tokenizer, conversation)
        rows = hf_hidden_states(model_dir, ids, LAYERS)  # [T, 4, H]
        out.append(
            {
                "ids": ids,
                "mask": mask,
                "aux": rows[:, :3].reshape(len(ids), 3 * HIDDEN),
                "last": rows[:, 3],
            }
        )
    return out


SPECFORGE = SpecForgeFiles()


def _close(actual: torch.Tensor, wanted: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float32, (what, actual.dtype)
    assert_states_close(actual, wanted, dtype=torch.float32, what=what)


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("compress", [False, True], ids=["ckpt", "ckpt.gz"])
def test_specforge_reader_gets_hf_rows(
    llm, conversations, expected, tmp_path, run_extract, compress
):
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    out = tmp_path / "specforge"
    result = run_extract(
        llm,
        conversations,
        out,
        layers=LAYERS,
        trainer_format="specforge",
        compress=compress,
    )
    assert result.samples == NUM and not result.skipped
    suffix = ".ckpt.gz" if compress else ".ckpt"
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == sorted(
        [f"{HS_DIR}/rows_0-2000/data_{i}{suffix}" for i in range(NUM)]
        + [MANIFEST, "skipped.jsonl"]
    ), names  # no Arrow dataset, no token_freq.pt
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["trainer_format"] == "specforge"
    assert manifest["layers"] == LAYERS and manifest["compress"] is compress

    refs = OfflineManifestReader(str(out / HS_DIR), validate_files=True).read()
    assert len(refs) == NUM
    store = LocalFeatureStore()
    seen = set()
    for ref in refs:
        raw, _ = store.get(ref)  # the four training tensors only
        path = Path(ref.feature_store_uri.removeprefix("file://"))
        i = SPECFORGE.read_meta(path).input_index
        seen.add(i)
        want = expected[i]
        sample = normalize_offline_sample(raw, max_len=2048)
        t = len(want["ids"])
        assert sample["input_ids"].tolist() == [want["ids"]]
        # SpecForge zeroes the last position's loss itself.
        assert sample["loss_mask"].tolist() == [[*want["mask"][:-1], 0]]
        assert tuple(sample["hidden_state"].shape) == (1, t, 3 * HIDDEN)
        _close(sample["hidden_state"][0], want["aux"], f"specforge aux {i}")
        _close(sample["target"][0], want["last"], f"specforge target {i}")
    assert seen == set(range(NUM))
    if compress:
        # SpecForge's legacy dataset (the USP path) reads the same files.
        from specforge.data.preprocessing import build_offline_eagle3_dataset

        assert len(build_offline_eagle3_dataset(str(out / HS_DIR), max_len=2048)) == NUM


def _modelopt_reader() -> Any:
    """ModelOpt's offline reader module, loaded from the installed package by
    path (see requirements/trainer-readers.txt)."""
    spec = importlib.util.find_spec("modelopt")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {k: v for k, v in sys.modules.items() if k.startswith("modelopt")}
    try:
        for name in (
            "modelopt",
            "modelopt.torch",
            "modelopt.torch.utils",
            "modelopt.torch.speculative",
            "modelopt.torch.speculative.eagle",
        ):
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        modules = {}
        for name, relative in (
            ("modelopt.torch.utils.loss_mask", "torch/utils/loss_mask.py"),
            (
                "modelopt.torch.speculative.eagle.utils",
                "torch/speculative/eagle/utils.py",
            ),
        ):
            module_spec = importlib.util.spec_from_file_location(name, root / relative)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            modules[name] = module
        return modules["modelopt.torch.speculative.eagle.utils"]
    finally:
        for name in [k for k in sys.modules if k.startswith("modelopt")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_modelopt_reader_gets_hf_rows(
    llm, conversations, expected, tmp_path, run_extract
):
    eagle = _modelopt_reader()
    out = tmp_path / "modelopt"
    result = run_extract(
        llm, conversations, out, layers=LAYERS, trainer_format="modelopt"
    )
    assert result.samples == NUM
    files = sorted(str(p) for p in (out / HS_DIR).rglob("*.pt"))  # its discovery
    assert [Path(f).name for f in files] == sorted(f"{i}.pt" for i in range(NUM))
    assert not list(out.glob("*.pt"))  # nothing else a *.pt walk could take
    dataset = eagle.OfflineSupervisedDataset(files, answer_only_loss=True)
    items = []
    for k, path in enumerate(files):
        i = int(Path(path).stem)
        want = expected[i]
        item = dataset[k]
        items.append(item)
        assert torch.load(path, weights_only=True)["conversation_id"] == i
        assert item["input_ids"].tolist() == want["ids"]
        assert item["loss_mask"].tolist() == want["mask"]
        assert item["labels"].tolist() == [*want["ids"][1:], -100]
        assert item["base_hidden_prenorm"] is False  # post-norm rows
        _close(item["aux_hidden_states"], want["aux"], f"modelopt aux {i}")
        _close(item["base_model_hidden_states"], want["last"], f"modelopt last {i}")
    batch = eagle.EagleOfflineDataCollator(train_len=256)(items[:3])
    outputs = batch["base_model_outputs"]
    assert tuple(outputs["aux_hidden_states"].shape) == (3, 256, 3 * HIDDEN)
    assert tuple(outputs["base_model_hidden_states"].shape) == (3, 256, HIDDEN)


@pytest.mark.parametrize("trainer", ["specforge", "modelopt"])
def test_shards_merge_and_resume_to_the_same_files(
    llm, conversations, tmp_path, run_extract, trainer
):
    whole = tmp_path / "whole"
    run_extract(llm, conversations, whole, layers=LAYERS, trainer_format=trainer)
    sharded = tmp_path / "sharded"
    for shard in range(2):
        run_extract(
            llm,
            conversations,
            shard_dir(sharded, shard, 2),
            layers=LAYERS,
            trainer_format=trainer,
            num_shards=2,
            shard_index=shard,
        )
    assert merge_shards(sharded).samples == NUM
    assert _digests(sharded / HS_DIR) == _digests(whole / HS_DIR)
    # An interrupted run: its manifest, some finished files, a partial write.
    resumed = tmp_path / "resumed"
    (resumed / HS_DIR).mkdir(parents=True)
    manifest = json.loads((whole / MANIFEST).read_text())
    for key in ("samples", "tokens", "bytes", "skipped", "rejected"):
        del manifest[key]
    manifest["complete"] = False
    (resumed / MANIFEST).write_text(json.dumps(manifest))
    kept = sorted((whole / HS_DIR).rglob("*.*"))[:5]
    for path in kept:
        target = resumed / path.relative_to(whole)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    partial = resumed / kept[0].parent.relative_to(whole) / f".{kept[0].name}.Ab12Cd"
    partial.write_bytes(b"partial")
    result = run_extract(
        llm, conversations, resumed, layers=LAYERS, trainer_format=trainer, resume=True
    )
    assert result.written == NUM - len(kept)
    assert _digests(resumed / HS_DIR) == _digests(whole / HS_DIR)
    with pytest.raises(VllmHsError, match="other settings.*trainer_format"):
        run_extract(llm, conversations, resumed, layers=LAYERS, resume=True)


@pytest.mark.parametrize(
    ("trainer", "kwargs", "match"),
    [
        ("specforge", {"layers": [1, 2, 3, 4]}, "must be final_norm"),
        ("specforge", {"layers": [1, 3, "final_norm"]}, "exactly 3 aux layers"),
        ("modelopt", {"layers": [3, 1, "final_norm"]}, "ascending"),
        ("modelopt", {"storage_dtype": "fp8"}, "cannot read its scales"),
        ("modelopt", {"compress": True}, "--compress is for --format specforge"),
    ],
)
def test_what_a_trainer_cannot_read_is_refused(
    llm, conversations, tmp_path, run_extract, trainer, kwargs, match
):
    kwargs.setdefault("layers", LAYERS)
    out = tmp_path / "refused"
    with pytest.raises(VllmHsError, match=match):
        run_extract(llm, conversations, out, trainer_format=trainer, **kwargs)
    assert not out.exists()


def test_default_layers_end_with_final_norm():
    """The trainers' default aux ids [1, L//2 - 1, L - 4] are vllm-hs's
    [2, L//2, L - 3]; the tiny model's collide and are spread instead."""
    from vllm_hs.extract.formats import sample_files

    for trainer in ("specforge", "modelopt"):
        files = sample_files(trainer)
        assert files.default_layers(32) == [2, 16, 29, "final_norm"]
        assert files.default_layers(4) == LAYERS
    assert sample_files("speculators").default_layers(32) == [2, 16, 29, 32]


def test_a_compressed_sample_is_the_same_bytes_wherever_written(tmp_path: Path):
    """The gzip header holds mtime 0 and the final file name, never the random
    temporary name the file was written under."""
    import gzip

    files = SpecForgeFiles(compress=True)
    states = {"hidden_states": torch.arange(24, dtype=torch.float32).view(2, 4, 3)}
    written = []
    for name in ("a", "b"):
        path = files.path(tmp_path / name, 7, 7)
        files.save(path, states, torch.tensor([5, 6]), 7, [0, 1])
        written.append(path.read_bytes())
    assert written[0] == written[1]
    assert b"data_7.ckpt\0" in written[0][:40]
    assert files.read_meta(path).input_index == 7
    assert gzip.decompress(written[0])
