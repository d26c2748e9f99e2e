"""Tests of vllm_hs.hf_reference: layer-id convention, helpers, tolerance checks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_hs.hf_reference import (  # noqa: E402
    TOLERANCES,
    assert_states_close,
    hf_greedy,
    hf_hidden_states,
    hf_sequence_states,
    load_hf_model,
    tolerances_for,
)
from vllm_hs.layer_ids import FINAL_NORM, resolve_layer_ids  # noqa: E402
from vllm_hs.models.tiny import build_tiny_model  # noqa: E402

L = 4  # num_hidden_layers of the default tiny model
ALL_LAYERS = [*range(L + 1), FINAL_NORM]
DTYPES = ["float32", "bfloat16"]


def token_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return rng.sample(range(5, 1024), n)  # distinct, no special tokens


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module", params=DTYPES)
def llama(request: pytest.FixtureRequest, cache: Path) -> tuple[Path, str]:
    return build_tiny_model("llama", request.param, cache_dir=cache), request.param


def test_shapes_dtype_and_column_order(llama: tuple[Path, str]) -> None:
    path, dtype = llama
    ids = token_ids(11, 0)
    states = hf_hidden_states(path, ids, ALL_LAYERS)
    assert states.shape == (11, L + 2, 128)
    assert states.dtype == getattr(torch, dtype)
    swapped = hf_hidden_states(path, ids, [FINAL_NORM, 2, 0])
    assert torch.equal(swapped, states[:, [L + 1, 2, 0]])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_layer_convention(cache: Path, arch: str) -> None:
    path = build_tiny_model(arch, cache_dir=cache)
    model = load_hf_model(path)
    ids = token_ids(9, 1)
    states = hf_hidden_states(path, ids, [0, 1, 2, 3, 4, -1, FINAL_NORM])
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        embedded = model.model.embed_tokens(torch.tensor(ids))
        normed = model.model.norm(states[:, 4])
        logits = model.lm_head(states[:, 6])
    # id 0 is the embedding lookup; id k < L is HF hidden_states[k].
    assert torch.equal(states[:, 0], embedded)
    for k in range(L):
        assert torch.equal(states[:, k], out.hidden_states[k][0])
    # id L is the input of the final norm, final_norm its output = hidden_states[-1].
    assert torch.equal(normed, states[:, 6])
    assert torch.equal(states[:, 6], out.hidden_states[-1][0])
    assert torch.equal(logits, out.logits[0])
    assert not torch.allclose(states[:, 4], states[:, 6], atol=1e-1)
    # -1 means L.
    assert torch.equal(states[:, 5], states[:, 4])


def test_resolve_layer_ids() -> None:
    assert resolve_layer_ids([0, -1, FINAL_NORM, L], L) == [0, L, FINAL_NORM, L]
    for bad in ([L + 1], [-2], ["final"]):
        with pytest.raises(ValueError):
            resolve_layer_ids(bad, L)
    with pytest.raises(ValueError, match="empty"):
        resolve_layer_ids([], L)
    with pytest.raises(TypeError):
        resolve_layer_ids(3, L)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        resolve_layer_ids([1.0], L)  # type: ignore[list-item]


def test_load_is_cached_eager_eval(llama: tuple[Path, str]) -> None:
    path, dtype = llama
    model = load_hf_model(path)
    assert load_hf_model(str(path), dtype) is model
    assert not model.training
    assert model.config._attn_implementation == "eager"
    assert model.dtype == getattr(torch, dtype)
    upcast = load_hf_model(path, "float32")
    assert upcast.dtype == torch.float32


def test_invalid_token_ids(llama: tuple[Path, str]) -> None:
    path, _ = llama
    with pytest.raises(ValueError, match="out of range"):
        hf_hidden_states(path, [1, 1024], [0])
    with pytest.raises(ValueError, match="empty"):
        hf_hidden_states(path, [], [0])


def test_greedy_matches_generate_and_states(llama: tuple[Path, str]) -> None:
    path, _ = llama
    prompt = token_ids(6, 2)
    output = hf_greedy(path, prompt, 12)
    assert len(output) == 12
    assert len(set(output)) > 3
    model = load_hf_model(path)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=12,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    assert output[: len(ref)] == ref
    # Each final-norm row predicts the next token: prompt's last row -> output[0],
    # output row j (position of output[j]) -> output[j + 1].
    prompt_rows, output_rows = hf_sequence_states(path, prompt, output, [0, FINAL_NORM])
    assert prompt_rows.shape == (6, 2, 128)
    assert output_rows.shape == (11, 2, 128)
    with torch.no_grad():
        predicted = model.lm_head(
            torch.cat([prompt_rows[-1:, 1], output_rows[:, 1]])
        ).argmax(-1)
    assert predicted.tolist() == output
    embedded = model.model.embed_tokens(torch.tensor(output[:-1]))
    assert torch.equal(output_rows[:, 0], embedded)


def test_greedy_stop_at_eos(cache: Path) -> None:
    path = build_tiny_model(cache_dir=cache)
    prompt = token_ids(5, 3)
    output = hf_greedy(path, prompt, 10)
    assert hf_greedy(path, prompt, 0) == []
    model = load_hf_model(path)
    eos = model.config.eos_token_id
    model.config.eos_token_id = output[3]  # pretend the 4th token is EOS
    try:
        stop = output.index(output[3]) + 1
        assert hf_greedy(path, prompt, 10, stop_at_eos=True) == output[:stop]
        assert hf_greedy(path, prompt, 10) == output
    finally:
        model.config.eos_token_id = eos


def test_sequence_states_edges(cache: Path) -> None:
    path = build_tiny_model(cache_dir=cache)
    prompt = token_ids(7, 4)
    alone = hf_hidden_states(path, prompt, [2, -1])
    for output in ([], [9]):
        prompt_rows, output_rows = hf_sequence_states(path, prompt, output, [2, -1])
        assert torch.equal(prompt_rows, alone)
        assert output_rows.shape == (0, 2, 128)
    # Prompt rows do not depend on what follows (causal attention).
    prompt_rows, output_rows = hf_sequence_states(path, prompt, [9, 10, 11], [2, -1])
    assert output_rows.shape == (2, 2, 128)
    assert_states_close(prompt_rows, alone, dtype="float32", what="prompt rows")


def test_tolerances_known_dtypes() -> None:
    assert set(TOLERANCES) == {torch.float32, torch.bfloat16}
    assert tolerances_for("float32") == tolerances_for(torch.float32)
    assert tolerances_for("bfloat16").row_rtol > tolerances_for("float32").row_rtol
    with pytest.raises(ValueError, match="no tolerances"):
        tolerances_for("float16")


def other_implementation_states(path: Path, ids: list[int], dtype: str) -> torch.Tensor:
    """The same states from a different numeric path (sdpa attention): what an
    engine's kernels look like to the check."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).eval()
    captured: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(
        lambda _m, args: captured.append(args[0])
    )
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    columns = [*out.hidden_states[:-1], captured[0], out.hidden_states[-1]]
    return torch.stack([c[0] for c in columns], dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_accepts_other_implementation_noise(cache: Path, arch: str, dtype: str) -> None:
    path = build_tiny_model(arch, dtype, cache_dir=cache)
    ids = token_ids(128, 5)
    expected = hf_hidden_states(path, ids, ALL_LAYERS)
    actual = other_implementation_states(path, ids, dtype)
    assert not torch.equal(actual[:, 1:], expected[:, 1:])  # really a different path
    assert_states_close(actual, expected, dtype=dtype, what="sdpa vs eager")
    if dtype == "bfloat16":
        # bf16 compute vs the same bf16 weights computed in fp32.
        upcast = hf_hidden_states(path, ids, ALL_LAYERS, dtype="float32")
        assert_states_close(upcast, expected, dtype=dtype, what="fp32 compute")


@pytest.fixture(scope="module")
def reference(llama: tuple[Path, str]) -> tuple[torch.Tensor, str, list[int], Path]:
    path, dtype = llama
    ids = token_ids(24, 6)
    return hf_hidden_states(path, ids, ALL_LAYERS), dtype, ids, path


def check_caught(actual: torch.Tensor, expected: torch.Tensor, dtype: str) -> str:
    with pytest.raises(AssertionError) as info:
        assert_states_close(actual, expected, dtype=dtype, what="case", layers=None)
    message = str(info.value)
    assert "row" in message and "column" in message and "max abs diff" in message
    return message


def test_same_states_pass(reference: tuple[torch.Tensor, str, list[int], Path]) -> None:
    states, dtype, _, _ = reference
    assert_states_close(states.clone(), states, dtype=dtype, what="identical")
    assert_states_close(states[:0], states[:0], dtype=dtype, what="no rows")


def test_one_layer_shift_is_caught(
    reference: tuple[torch.Tensor, str, list[int], Path],
) -> None:
    states, dtype, _, _ = reference
    # Off by one layer id: e.g. "output of layer k" delivered for "input of layer k".
    check_caught(states[:, 1 : L + 1], states[:, :L], dtype)
    for k in range(L):
        check_caught(states[:, k + 1 : k + 2], states[:, k : k + 1], dtype)
    # Post-norm delivered for pre-norm (id L) and the other way round.
    check_caught(states[:, L + 1], states[:, L], dtype)
    check_caught(states[:, L], states[:, L + 1], dtype)


def test_one_position_shift_is_caught(
    reference: tuple[torch.Tensor, str, list[int], Path],
) -> None:
    states, dtype, _, _ = reference
    check_caught(states[1:], states[:-1], dtype)
    check_caught(states[:-1], states[1:], dtype)
    for k in range(L + 2):
        check_caught(states[1:, k], states[:-1, k], dtype)


def test_zeros_are_caught(reference: tuple[torch.Tensor, str, list[int], Path]) -> None:
    states, dtype, _, _ = reference
    check_caught(torch.zeros_like(states), states, dtype)
    for k in range(L + 2):
        check_caught(torch.zeros_like(states[:, k]), states[:, k], dtype)


def test_rows_of_another_sequence_are_caught(
    reference: tuple[torch.Tensor, str, list[int], Path],
) -> None:
    states, dtype, ids, path = reference
    other = hf_hidden_states(path, token_ids(len(ids), 7), ALL_LAYERS)
    check_caught(other, states, dtype)
    # Same prefix, different tail: only the rows after the divergence are wrong.
    tail = hf_hidden_states(path, ids[:12] + token_ids(12, 8), ALL_LAYERS)
    message = check_caught(tail, states, dtype)
    assert "first [12," in message


def test_message_names_row_and_layer(
    reference: tuple[torch.Tensor, str, list[int], Path],
) -> None:
    states, dtype, _, _ = reference
    broken = states.clone()
    broken[7, 2] = states[8, 2]  # one row of one layer taken from the next position
    with pytest.raises(AssertionError) as info:
        assert_states_close(
            broken, states, dtype=dtype, what="decode", layers=ALL_LAYERS, row_offset=30
        )
    message = str(info.value)
    assert message.startswith("decode: ")
    assert "worst: row 7 (position 37), column 2 (layer 2)" in message
    assert "column 2 (layer 2): RMS" in message and "1 bad rows, first [7]" in message
    assert "column 3 (layer 3): RMS" in message and "ok" in message


def test_nan_and_shape_mismatch_fail(
    reference: tuple[torch.Tensor, str, list[int], Path],
) -> None:
    states, dtype, _, _ = reference
    broken = states.clone()
    broken[3, 1, 5] = float("nan")
    message = check_caught(broken, states, dtype)
    assert "row 3 (position 3), column 1" in message
    check_caught(states, broken, dtype)  # NaN in expected fails too
    with pytest.raises(AssertionError, match="shape"):
        assert_states_close(states[1:], states, dtype=dtype, what="short")
