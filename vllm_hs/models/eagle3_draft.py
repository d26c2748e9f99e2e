"""A tiny EAGLE-3 draft for the tiny target model, trained offline so that
speculation accepts some of its drafts.

`build_eagle3_draft(target)` writes a speculators-format EAGLE-3 checkpoint
(speculators' `Eagle3DraftModel`: one Llama decoder layer over the target's
embeddings and LM head) that vLLM loads with
``speculative_config={"method": "eagle3", "model": <dir>}``. It is trained the
way speculators trains drafts (`Eagle3DraftModel.forward` with its eager
KL-divergence loss, batches shifted by `speculators.models.eagle3.data.
shift_batch`, three test-time-training steps) on the target's own greedy
continuations of `training_prompts()`, with the target's states from HF
transformers at the draft's aux layers and at L (the last layer's output,
before the final norm: speculators' "verifier last hidden state").

A few hundred steps on ~4k tokens make it memorize the target on those
sequences: vLLM then accepts ~15% of 3-token drafts on `training_prompts()`
and ~0 elsewhere. Enough to exercise accepted and rejected drafts, and to see
whether the channel changes what the draft proposes; not a realistic draft.
Built once per arguments and cached under ``<cache root>/models/eagle3-<hash>``
(about 40 s on 2 cores).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from vllm_hs.models.tiny import build_cached, seeded_prompt

__all__ = ["DEFAULT_AUX_LAYERS", "build_eagle3_draft", "training_prompts"]

#: Bump when the files a build writes change for the same arguments.
FORMAT_VERSION = 1

#: The draft's aux layers in a 4-layer target: the inputs of layers 1, 2, 3.
DEFAULT_AUX_LAYERS = (1, 2, 3)

PROMPT_SEED = 1000
PROMPT_LEN = 16
NEW_TOKENS = 112


def training_prompts(num: int = 32) -> list[list[int]]:
    """The prompts whose continuations the draft is trained on (the first
    `num` of them: the same for any `num`)."""
    return [seeded_prompt(PROMPT_SEED + i, PROMPT_LEN) for i in range(num)]


def build_eagle3_draft(
    target: Path | str,
    *,
    aux_layers: tuple[int, ...] = DEFAULT_AUX_LAYERS,
    num_sequences: int = 32,
    steps: int = 600,
    num_speculative_tokens: int = 3,
    seed: int = 0,
    cache_dir: Path | None = None,
) -> Path:
    """Build (or reuse from the cache) an EAGLE-3 draft for `target`; return
    its directory. `aux_layers` use the channel's convention (id k < L: the
    residual stream entering decoder layer k)."""
    from importlib.metadata import version

    args: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "speculators": version("speculators"),
        "target": str(Path(target).resolve()),
        "aux_layers": list(aux_layers),
        "num_sequences": num_sequences,
        "steps": steps,
        "num_speculative_tokens": num_speculative_tokens,
        "seed": seed,
    }
    return build_cached("eagle3", args, _write_draft, cache_dir)


def _training_data(
    target: str, aux_layers: list[int], num_sequences: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids [T], states [T, len(aux_layers) + 1, H]) per sequence: the
    target's greedy continuation and its states at the aux layers and L."""
    from transformers import AutoConfig

    from vllm_hs.hf_reference import hf_greedy, hf_hidden_states

    num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    data = []
    for prompt in training_prompts(num_sequences):
        ids = prompt + hf_greedy(target, prompt, NEW_TOKENS)
        states = hf_hidden_states(target, ids, [*aux_layers, num_layers])
        data.append((torch.tensor(ids), states))
    return data


def _write_draft(out: Path, args: dict[str, Any]) -> None:
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.proposals import GreedyTokenProposalConfig
    from transformers import AutoConfig

    target = args["target"]
    aux_layers = args["aux_layers"]
    num_spec = args["num_speculative_tokens"]
    data = _training_data(target, aux_layers, args["num_sequences"])

    layer_config = AutoConfig.from_pretrained(target)
    layer_config.num_hidden_layers = 1
    layer_config._attn_implementation = "eager"
    torch.manual_seed(args["seed"])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=layer_config.vocab_size,
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=aux_layers,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=num_spec)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(target),
        ),
    )
    model = Eagle3DraftModel(config)
    model.load_verifier_weights()  # the target's embeddings, norm and LM head
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    loss_config = resolve_loss_config("kl_div", "eager")  # no Triton here
    order = random.Random(args["seed"])
    num_aux = len(aux_layers)
    for _ in range(args["steps"]):
        ids, states = data[order.randrange(len(data))]
        length = ids.shape[0]
        batch = shift_batch(
            {
                "input_ids": ids,
                "hidden_states": states[:, :num_aux].flatten(1),
                "verifier_last_hidden_states": states[:, num_aux],
                "loss_mask": torch.ones(length, dtype=torch.bool),
                "lengths": torch.tensor([length]),
                "position_ids": torch.arange(length),
            }
        )
        _, loss, _ = model(
            hidden_states=batch["hidden_states"][None],
            input_ids=batch["input_ids"][None],
            document_ids=torch.zeros(1, length - 1, dtype=torch.long),
            loss_mask=batch["loss_mask"][None],
            position_ids=batch["position_ids"][None],
            verifier_last_hidden_states=batch["verifier_last_hidden_states"][None],
            ttt_steps=num_spec,
            loss_config=loss_config,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
