"""HuggingFace transformers reference for hidden states: the ground truth that engine
tests compare against.

Layer ids follow `vllm_hs.layer_ids` (vLLM's EAGLE-3 convention): ``k`` < ``L``
is the residual stream entering decoder layer ``k``, ``L`` (or ``-1``) the last
layer's output before the final norm (captured from the final norm's input),
``"final_norm"`` the LM head's input.

Tensors are ``[T, K, H]``: row ``t`` is the position of ``token_ids[t]``, column
``k`` is ``layers[k]``, dtype is the model's dtype. One forward pass over the whole
sequence, batch 1, no padding, eager attention, CPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_hs.layer_ids import FINAL_NORM, LayerId, resolve_layer_ids

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "assert_states_close",
    "clear_hf_model_cache",
    "hf_greedy",
    "hf_hidden_states",
    "hf_sequence_states",
    "load_hf_model",
    "tolerances_for",
]


@dataclass(frozen=True)
class Tolerance:
    """Tolerances of `assert_states_close`; both checks must pass.

    * per element: ``|a - e| <= atol * scale_k + rtol * |e|``, ``scale_k`` = RMS of
      the expected values of layer column ``k`` (all rows). Per-column scaling
      matters: in the tiny models the embedding column has RMS ~0.2, the deeper
      residual columns ~10-25.
    * per (row, column): ``||a - e||_2 <= row_rtol * ||e||_2`` over the hidden
      dimension.
    """

    atol: float
    rtol: float
    row_rtol: float


#: Chosen from measurements on the tiny models (3 archs x seeds 0-2, 32/128/512
#: tokens; "el" = max over elements of ``|a - e| / (scale_k + |e|)``, "row" = max
#: relative L2 error of a row):
#:
#: * float32: fp32 vs float64 compute el <= 1.0e-5, row <= 4.2e-6; eager vs sdpa
#:   attention el <= 7.2e-6, row <= 3.1e-6 (vLLM vs HF: ~4e-6 at the final norm).
#:   1e-4 leaves a 10x margin; a wrong row or layer is off by ~0.3-1.
#: * bfloat16: bf16 compute vs the same bf16 weights computed in fp32 el <= 0.19,
#:   row <= 0.074 (0.15 / 0.070 up to 128 tokens); bf16 eager vs sdpa el <= 0.14,
#:   row <= 0.061. That is far more than "a few ulps": rounding of the attention
#:   logits and of every layer output is amplified through 4 layers. Two bf16
#:   implementations each carry such an error, hence el 0.3 and row 0.15 (good up
#:   to ~512 tokens).
#:
#: Mis-associations stay far outside in both dtypes (128 distinct tokens, every
#: row and every column): a one-layer shift has row >= 0.34 (el >= 1.9 in each
#: column); pre-norm vs final_norm row >= 0.93; a one-position shift row >= 0.95;
#: another sequence row >= 1.06; zeros row = 1.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4, row_rtol=1e-4),
    torch.bfloat16: Tolerance(atol=0.3, rtol=0.3, row_rtol=0.15),
}

_MODEL_CACHE: dict[tuple[str, torch.dtype], Any] = {}


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def load_hf_model(model_dir: Path | str, dtype: torch.dtype | str | None = None) -> Any:
    """Load a causal LM from a local directory: eval mode, CPU, eager attention.

    ``dtype=None`` (or ``"auto"``) uses the dtype in ``config.json``. Models are
    cached per (resolved directory, dtype) for the life of the process; callers
    must not modify the returned model.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    directory = str(Path(model_dir).resolve())
    torch_dtype = _as_dtype(dtype)
    if torch_dtype is None:
        torch_dtype = _config_dtype(directory)
    key = (directory, torch_dtype)
    model = _MODEL_CACHE.get(key)
    if model is None:
        config = json.loads((Path(directory) / "config.json").read_text())
        auto = (
            AutoModelForImageTextToText
            if "vision_config" in config
            else AutoModelForCausalLM
        )
        model = auto.from_pretrained(
            directory, dtype=torch_dtype, attn_implementation="eager", device_map=None
        )
        model.to("cpu").eval()
        _MODEL_CACHE[key] = model
    return model


def _config_dtype(model_dir: str) -> torch.dtype:
    """The dtype in ``config.json`` (``dtype`` or legacy ``torch_dtype``); float32
    when absent, as transformers does."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    value = _as_dtype(name)
    return value if value is not None else torch.float32


def clear_hf_model_cache() -> None:
    """Drop every model cached by `load_hf_model`."""
    _MODEL_CACHE.clear()


def _check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:8]}")
    return ids


#: Where HF causal LMs keep their decoder stack, its layers and its final norm.
_INNER_MODEL_NAMES = ("model", "backbone", "transformer")
_LAYER_LIST_NAMES = ("layers", "h")
_FINAL_NORM_NAMES = ("norm", "norm_f", "final_layernorm", "ln_f")


def _find_attr(obj: Any, names: Sequence[str]) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    raise AttributeError(f"{type(obj).__name__} has none of {list(names)}")


@torch.no_grad()
def hf_hidden_states(
    model_dir: Path | str,
    token_ids: Sequence[int],
    layers: Sequence[LayerId],
    *,
    dtype: torch.dtype | str | None = None,
    images: Sequence[Any] = (),
) -> torch.Tensor:
    """Hidden states ``[T, K, H]`` of ``token_ids`` at ``layers`` (module docstring
    for the id convention), in the model's dtype, from one forward pass.

    Read with forward hooks, so any decoder stack works (hybrid and MoE models
    included): id ``k < L`` is the ``hidden_states`` input of decoder layer
    ``k``, ``L`` the input of the final norm and ``final_norm`` its output.
    Where HF's ``output_hidden_states`` has ``L + 1`` entries they must agree
    with the hooks exactly.

    A vision-language model gets ``images`` (PIL images, in prompt order), made
    into pixels by the model's own image processor: ``token_ids`` then hold
    the expanded prompt, one image token per image embedding, as vLLM's
    ``prompt_token_ids`` do."""
    model = load_hf_model(model_dir, dtype)
    inner = _find_attr(model, _INNER_MODEL_NAMES)
    if not hasattr(inner, "layers") and hasattr(inner, "language_model"):
        inner = inner.language_model
    decoder_layers = _find_attr(inner, _LAYER_LIST_NAMES)
    norm = _find_attr(inner, _FINAL_NORM_NAMES)
    text_config = model.config.get_text_config()
    num_layers = text_config.num_hidden_layers
    if len(decoder_layers) != num_layers:
        raise RuntimeError(
            f"{len(decoder_layers)} decoder layers for num_hidden_layers={num_layers}"
        )
    ids = _check_token_ids(token_ids, text_config.vocab_size)
    resolved = resolve_layer_ids(layers, num_layers)

    # Built before the hooks go on the cached model: a refused image input
    # must not leave them there.
    inputs = {"input_ids": torch.tensor([ids], dtype=torch.long)}
    if images:
        inputs.update(_image_inputs(model_dir, model.config, ids, images))

    captured: dict[LayerId, torch.Tensor] = {}

    def layer_input(k: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            value = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured.setdefault(k, value[0].detach().clone())

        return hook

    def norm_input(_module: Any, args: tuple[Any, ...]) -> None:
        captured.setdefault(num_layers, args[0][0].detach().clone())

    def norm_output(_module: Any, _args: tuple[Any, ...], out: Any) -> None:
        value = out[0] if isinstance(out, tuple) else out
        captured.setdefault(FINAL_NORM, value[0].detach().clone())

    handles = [
        layer.register_forward_pre_hook(layer_input(k), with_kwargs=True)
        for k, layer in enumerate(decoder_layers)
    ]
    handles.append(norm.register_forward_pre_hook(norm_input))
    handles.append(norm.register_forward_hook(norm_output))
    try:
        out = model(**inputs, output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if len(captured) != num_layers + 2:
        raise RuntimeError(
            f"unexpected HF forward: captured {sorted(map(str, captured))} of "
            f"{num_layers} layers, the final norm's input and output"
        )
    hidden = out.hidden_states
    if hidden is not None and len(hidden) == num_layers + 1:
        pairs = [(hidden[k][0], captured[k]) for k in range(num_layers)]
        pairs.append((hidden[-1][0], captured[FINAL_NORM]))
        if not all(torch.equal(a, b) for a, b in pairs):
            raise RuntimeError("output_hidden_states disagrees with the layer hooks")
    columns = [captured[layer] for layer in resolved]
    return torch.stack(columns, dim=1).contiguous()


def _image_inputs(
    model_dir: Path | str, config: Any, ids: list[int], images: Sequence[Any]
) -> dict[str, torch.Tensor]:
    """The vision inputs of a forward over ``ids``: pixels and grids from the
    model's image processor, and the token types that place the image
    positions (without them transformers' Qwen2-VL family falls back to 1-D
    positions)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    vision = processor(images=list(images), return_tensors="pt")
    grid = vision["image_grid_thw"]
    num_embeds = int(grid.prod(dim=-1).sum()) // processor.merge_size**2
    types = [int(t == config.image_token_id) for t in ids]
    if sum(types) != num_embeds:
        raise ValueError(
            f"{sum(types)} image tokens in the sequence for {len(images)} images "
            f"of {num_embeds} embeddings"
        )
    return {
        "pixel_values": vision["pixel_values"],
        "image_grid_thw": grid,
        "mm_token_type_ids": torch.tensor([types], dtype=torch.long),
    }


def hf_sequence_states(
    model_dir: Path | str,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    layers: Sequence[LayerId],
    *,
    dtype: torch.dtype | str | None = None,
    images: Sequence[Any] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """States for a prompt and its generated tokens: ``(prompt_rows [P, K, H],
    output_rows [G - 1, K, H])``.

    Computed on ``prompt_ids + output_ids[:-1]``: the last sampled token never
    enters the model, so output row ``j`` is the position of ``output_ids[j]``
    (whose states produced ``output_ids[j + 1]``). ``G = 0`` gives ``[0, K, H]``.
    """
    prompt = [int(t) for t in prompt_ids]
    output = [int(t) for t in output_ids]
    states = hf_hidden_states(
        model_dir, prompt + output[:-1], layers, dtype=dtype, images=images
    )
    return states[: len(prompt)], states[len(prompt) :]


@torch.no_grad()
def hf_greedy(
    model_dir: Path | str,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    dtype: torch.dtype | str | None = None,
    stop_at_eos: bool = False,
) -> list[int]:
    """Greedy (argmax) continuation of ``prompt_ids``: up to ``max_new_tokens`` new
    token ids, prompt excluded. Runs with a KV cache, like an engine does. EOS does
    not stop it unless ``stop_at_eos`` (then the EOS id is the last one returned).
    """
    model = load_hf_model(model_dir, dtype)
    ids = _check_token_ids(prompt_ids, model.config.vocab_size)
    eos = model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    generated: list[int] = []
    if max_new_tokens <= 0:
        return generated
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
    while True:
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        if len(generated) >= max_new_tokens or (stop_at_eos and token in eos_ids):
            return generated
        out = model(
            input_ids=torch.tensor([[token]], dtype=torch.long),
            past_key_values=out.past_key_values,
            use_cache=True,
        )


def tolerances_for(dtype: torch.dtype | str) -> Tolerance:
    """The `Tolerance` of `assert_states_close` for states of this dtype (see
    `TOLERANCES` for the measurements behind the values)."""
    torch_dtype = _as_dtype(dtype)
    if torch_dtype not in TOLERANCES:
        known = [str(d).removeprefix("torch.") for d in TOLERANCES]
        raise ValueError(f"no tolerances for dtype {dtype!r}; known: {known}")
    return TOLERANCES[torch_dtype]


def assert_states_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | str,
    what: str,
    layers: Sequence[LayerId] | None = None,
    tolerance: Tolerance | None = None,
    row_offset: int = 0,
) -> None:
    """Assert ``actual`` matches ``expected`` (both ``[T, K, H]``, or ``[T, H]``).

    Uses ``tolerance`` or `tolerances_for` ``(dtype)``; both the per-element and
    the per-row check of `Tolerance` must pass. Comparison is in float32;
    non-finite values (actual or expected) fail. On failure the AssertionError
    names ``what``, the worst row (position = ``row_offset`` + row index), layer
    column (with its id when ``layers`` is given), the max abs diff, and per
    column the max abs diff, worst row error and failing rows.
    """
    tol = tolerance if tolerance is not None else tolerances_for(dtype)
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if actual.dim() == 2:
        actual, expected = actual[:, None, :], expected[:, None, :]
    if actual.dim() != 3:
        raise AssertionError(
            f"{what}: expected [T, K, H] or [T, H], got {actual.shape}"
        )
    if layers is not None and len(layers) != actual.shape[1]:
        raise AssertionError(
            f"{what}: {len(layers)} layer ids for {actual.shape[1]} columns"
        )
    if actual.shape[0] == 0:
        return
    a = actual.detach().to("cpu", torch.float32)
    e = expected.detach().to("cpu", torch.float32)
    inf = float("inf")
    diff = (a - e).abs().nan_to_num(inf, inf, inf)  # [T, K, H]
    scale = e.pow(2).mean(dim=(0, 2), keepdim=True).sqrt()  # [1, K, 1]
    allowed = tol.atol * scale + tol.rtol * e.abs()
    bad_elem = ~(diff <= allowed)  # a NaN in expected makes `allowed` NaN: bad
    row_err = (a - e).norm(dim=2).nan_to_num(inf, inf, inf)  # [T, K]
    row_allowed = tol.row_rtol * e.norm(dim=2)
    bad_row = ~(row_err <= row_allowed) | bad_elem.any(dim=2)  # [T, K]
    if not bool(bad_row.any()):
        return

    def col_name(k: int) -> str:
        return (
            f"column {k} (layer {layers[k]!r})" if layers is not None else f"column {k}"
        )

    # Worst offender: largest ratio of error to allowance, elements and rows alike.
    elem_ratio = (diff / allowed.clamp_min(1e-30)).amax(dim=2)  # [T, K]
    row_ratio = row_err / row_allowed.clamp_min(1e-30)
    ratio = torch.maximum(elem_ratio, row_ratio)
    flat = int(ratio.argmax())
    row, col = divmod(flat, ratio.shape[1])
    h = int(diff[row, col].argmax())
    rel = row_err / e.norm(dim=2).clamp_min(1e-30)
    lines = [
        f"{what}: hidden states differ at {int(bad_row.sum())} of {bad_row.numel()} "
        f"(row, column) pairs ({int(bad_elem.sum())} elements); dtype {dtype}, "
        f"atol={tol.atol} x column RMS, rtol={tol.rtol}, row_rtol={tol.row_rtol}",
        f"  worst: row {row} (position {row + row_offset}), {col_name(col)}: "
        f"row L2 error {rel[row, col].item():.4g} x ||expected||; hidden index {h}: "
        f"actual {a[row, col, h].item():.6g}, expected {e[row, col, h].item():.6g}, "
        f"|diff| {diff[row, col, h].item():.6g}, "
        f"allowed {allowed[row, col, h].item():.3g}",
        f"  max abs diff: {diff.max().item():.6g}",
    ]
    for k in range(actual.shape[1]):
        rows = bad_row[:, k].nonzero().flatten().tolist()
        status = f"{len(rows)} bad rows, first {rows[:8]}" if rows else "ok"
        lines.append(
            f"  {col_name(k)}: RMS {scale[0, k, 0].item():.4g}, max abs diff "
            f"{diff[:, k].max().item():.4g}, max row error "
            f"{rel[:, k].max().item():.3g}: {status}"
        )
    raise AssertionError("\n".join(lines))
