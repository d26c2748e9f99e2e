"""Layer ids of `vllm-hs extract`: the default capture set, the ``--layers``
syntax, and what each column of ``hidden_states`` holds (for the manifest).

Layer ids (L = num_hidden_layers): ``k`` in ``0..L-1`` is the residual stream
entering decoder layer ``k`` (HF ``hidden_states[k]``); ``L`` is the last decoder
layer's output before the final norm; ``"final_norm"`` is the output of the final
norm. speculators reads the last column as the verifier's last hidden state and
the others as aux layers.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hs.errors import VllmHsError

__all__ = ["default_layers", "describe_layers", "parse_layers"]


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


def parse_layers(text: str | None, num_hidden_layers: int) -> list[int | str]:
    """``"2,16,29,32"`` -> ids resolved against the model (``-1`` -> L;
    ``final_norm`` allowed); None -> `default_layers`. Raises VllmHsError."""
    if text is None:
        return list(default_layers(num_hidden_layers))
    layers: list[int | str] = []
    for item in text.split(","):
        item = item.strip()
        if item == "final_norm":
            layers.append(item)
            continue
        try:
            layer = int(item)
        except ValueError:
            raise VllmHsError(
                f"--layers: {item!r} is not a layer id (integers 0..L, -1 for L, "
                "or final_norm)"
            ) from None
        if layer == -1:
            layer = num_hidden_layers
        if not 0 <= layer <= num_hidden_layers:
            raise VllmHsError(
                f"--layers: layer {layer} does not exist: the model has "
                f"{num_hidden_layers} decoder layers (ids 0..{num_hidden_layers}, "
                "-1 for the last, final_norm)"
            )
        layers.append(layer)
    if len(set(layers)) != len(layers):
        raise VllmHsError(f"--layers: duplicate layer ids in {layers}")
    if len(layers) < 2:
        raise VllmHsError(
            "--layers: give at least 2 layers (aux layers, then the verifier's "
            "last hidden state, which speculators reads as the last column)"
        )
    return layers


def describe_layers(layers: Sequence[int | str], num_hidden_layers: int) -> dict:
    """What each column of hidden_states is (written to the manifest)."""
    meaning = {}
    for column, layer in enumerate(layers):
        if layer == "final_norm":
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
