"""Layer ids: the one definition of what a layer id names, and their parsing.

The convention is vLLM's EAGLE-3 aux-hidden-state convention, and the patched
engine, `vllm_hs.hf_reference`, `vllm-hs extract` and the server all use it
(``L`` = ``num_hidden_layers``; docs/conventions.md tells it with positions):

* ``k`` in ``0..L-1``: the residual stream *entering* decoder layer ``k``
  (``hidden_states + residual`` in vLLM) = HF ``outputs.hidden_states[k]``;
  ``0`` is the embedding output.
* ``L``, and ``-1`` as its alias: the output of the last decoder layer *before*
  the final norm. (HF's ``hidden_states[L]`` is after the final norm in
  Llama/Qwen.)
* ``"final_norm"`` (`FINAL_NORM`): the output of the final norm, the LM head's
  input (HF ``hidden_states[-1]``).

speculators reads the last column as the verifier's last hidden state and the
others as aux layers.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hs.errors import VllmHsError

__all__ = [
    "FINAL_NORM",
    "LayerId",
    "default_layers",
    "describe_layers",
    "check_layer_ids",
    "parse_layers",
    "resolve_layer_ids",
    "split_layer_ids",
]

FINAL_NORM = "final_norm"

LayerId = int | str


def resolve_layer_ids(
    layers: Sequence[LayerId], num_hidden_layers: int
) -> list[LayerId]:
    """Validate layer ids and map ``-1`` to ``L``; returns ints in ``[0, L]`` or
    ``"final_norm"``. Raises ValueError or TypeError."""
    if isinstance(layers, (str, int)):
        raise TypeError("layers must be a sequence of layer ids, not a single id")
    num = num_hidden_layers
    out: list[LayerId] = []
    for layer in layers:
        if isinstance(layer, str):
            if layer != FINAL_NORM:
                raise ValueError(f"unknown layer id {layer!r}; strings: {FINAL_NORM!r}")
            out.append(layer)
        elif isinstance(layer, int) and not isinstance(layer, bool):
            if layer == -1:
                out.append(num)
            elif 0 <= layer <= num:
                out.append(layer)
            else:
                raise ValueError(
                    f"layer id {layer} out of range: allowed 0..{num} "
                    f"(num_hidden_layers), -1 (= {num}) or {FINAL_NORM!r}"
                )
        else:
            raise TypeError(f"layer id must be int or str, got {type(layer).__name__}")
    if not out:
        raise ValueError("layers must not be empty")
    return out


def default_layers(num_hidden_layers: int) -> list[int]:
    """speculators >= 0.5's capture set: aux layers ``[2, L//2, L-3]`` (the
    residual stream entering those layers) plus ``L`` (the last layer's output
    before the final norm, the verifier's last hidden state). Models with fewer
    than 8 layers, where those ids collide, get three aux layers spread over
    ``1..L-1`` instead (the tiny model: ``[1, 2, 3, 4]``)."""
    n = num_hidden_layers
    aux = [2, n // 2, n - 3]
    if len(set(aux)) < 3 or min(aux) < 1:
        aux = [round(1 + k * (n - 2) / 2) for k in range(3)] if n > 1 else []
    return list(dict.fromkeys([*(k for k in aux if 0 <= k < n), n]))


def parse_layers(text: str | None, num_hidden_layers: int) -> list[LayerId]:
    """``--layers`` of `vllm-hs extract`: ``"2,16,29,-1"`` -> ids resolved against
    the model (``-1`` -> L; ``final_norm`` allowed), at least two and no
    duplicates; None -> `default_layers`. Raises VllmHsError."""
    if text is None:
        return list(default_layers(num_hidden_layers))
    try:
        items = split_layer_ids(text)
    except ValueError as e:
        raise VllmHsError(f"--layers: {e}") from None
    return check_layer_ids(items, num_hidden_layers)


def split_layer_ids(text: str) -> list[LayerId]:
    """The ids of ``--layers`` text (``"2,16,29,-1"``), not yet checked against a
    model: at least two. Raises ValueError with the reason."""
    items: list[LayerId] = []
    for item in (part.strip() for part in text.split(",")):
        try:
            items.append(item if item == FINAL_NORM else int(item))
        except ValueError:
            raise ValueError(
                f"{item!r} is not a layer id (integers 0..L, -1 for L, or {FINAL_NORM})"
            ) from None
    if len(items) < 2:
        raise ValueError(
            "give at least 2 layers (aux layers, then the verifier's last hidden "
            "state, which speculators reads as the last column)"
        )
    return items


def check_layer_ids(layers: Sequence[LayerId], num_hidden_layers: int) -> list[LayerId]:
    """`resolve_layer_ids` with ``--layers``' messages, and no duplicates (``-1``
    and ``L`` are one). Raises VllmHsError."""
    try:
        resolved = resolve_layer_ids(layers, num_hidden_layers)
    except (ValueError, TypeError) as e:
        bad = [
            k
            for k in layers
            if isinstance(k, int) and k != -1 and not 0 <= k <= num_hidden_layers
        ]
        if not bad:
            raise VllmHsError(f"--layers: {e}") from None
        raise VllmHsError(
            f"--layers: layer {bad[0]} does not exist: the model has "
            f"{num_hidden_layers} decoder layers (ids 0..{num_hidden_layers}, "
            f"-1 for the last, {FINAL_NORM})"
        ) from None
    if len(set(resolved)) != len(resolved):
        raise VllmHsError(f"--layers: duplicate layer ids in {resolved}")
    return resolved


def describe_layers(layers: Sequence[LayerId], num_hidden_layers: int) -> dict:
    """What each column of hidden_states is (written to the manifest)."""
    meaning = {}
    for column, layer in enumerate(layers):
        if layer == FINAL_NORM:
            what = "output of the final norm (LM-head input)"
        elif layer == num_hidden_layers:
            what = "output of the last decoder layer, before the final norm"
        elif layer == 0:
            what = "embedding output (residual stream entering layer 0)"
        else:
            what = f"residual stream entering decoder layer {layer}"
        role = "verifier_last_hidden_states" if column == len(layers) - 1 else "aux"
        meaning[str(column)] = {"layer": layer, "role": role, "what": what}
    return meaning
