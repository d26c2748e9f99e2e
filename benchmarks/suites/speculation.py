"""Generation under speculative decoding (Model Runner V2) with hidden states
against without, batches alternating on one patched engine: ngram
(speculative) and EAGLE-3 (eagle3). The acceptance rate must not change with
states on."""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.result import Result, summarize
from benchmarks.suites.engine import (
    EngineSettings,
    engine_kwargs,
    engine_result,
    four_layers,
    model_dir,
    run_workload,
    workload_spec,
)

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def speculative(settings: EngineSettings) -> list[Result]:
    """Generation under ngram speculative decoding (Model Runner V2) with
    4-layer prompt and output states against without, batches alternating on
    one patched engine; prompts end with 128 tokens of the model's own greedy
    continuation, so that drafts are found and accepted where it repeats
    itself. Records each batch's draft and accepted tokens: the acceptance rate
    must not change with states on (greedy, the same tokens)."""
    path, sizes = model_dir(settings)
    return _speculation(
        "speculative",
        speculative.__doc__,
        settings,
        path,
        sizes,
        NGRAM,
        engine_kwargs(settings, four_layers(sizes)),
        self_continue=128,
    )


def eagle3(settings: EngineSettings) -> list[Result]:
    """Generation under EAGLE-3 speculative decoding (Model Runner V2, tiny
    model in float32) with 4-layer prompt and output states against without,
    batches alternating on one patched engine. The draft reads the target's
    layers 1, 2, 3 and the channel 1, 2, 3, 4 (one capture serves both); it is
    the tiny draft trained on the target's continuations of the 32 prompts
    used here (`vllm_hs.models.eagle3_draft`), so drafts are accepted.
    Records each batch's draft and accepted tokens: the acceptance rate must
    not change with states on."""
    if settings.model != "tiny":
        raise ValueError(
            "the eagle3 suite runs on --model tiny: its draft is trained for "
            f"the tiny model, not {settings.model!r}"
        )
    from vllm_hs.models.eagle3_draft import build_eagle3_draft, training_prompts

    path, sizes = model_dir(settings)
    draft = build_eagle3_draft(path)
    prompts = training_prompts(settings.prompts)
    engine = engine_kwargs(settings, four_layers(sizes))
    engine["dtype"] = "float32"
    engine["max_model_len"] = len(prompts[0]) + settings.max_tokens + 16
    config = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    return _speculation(
        "eagle3",
        eagle3.__doc__,
        settings,
        path,
        sizes,
        config,
        engine,
        prompt_ids=prompts,
        prompt_len=len(prompts[0]),
    )


def _speculation(
    name: str,
    doc: str | None,
    settings: EngineSettings,
    path: str,
    sizes: dict[str, int],
    speculative_config: dict[str, Any],
    engine: dict[str, Any],
    **spec_overrides: Any,
) -> list[Result]:
    """Throughput with 4-layer states / without under `speculative_config`,
    and the acceptance rate of each side, per round."""
    engine["speculative_config"] = speculative_config
    engine["disable_log_stats"] = False
    spec = workload_spec(
        settings,
        path,
        sizes,
        rounds=settings.rounds,
        variants={"plain": None, "states": {"prompt": True, "output": True}},
        engine=engine,
        spec_metrics=True,
        env={"VLLM_USE_V2_MODEL_RUNNER": "1"},
        **spec_overrides,
    )
    out = run_workload(sys.executable, spec)["timings"]
    rounds = []
    for r, (a, b) in enumerate(zip(out["plain"], out["states"], strict=True)):
        acceptance = [
            side["accepted_tokens"] / side["draft_tokens"]
            if side["draft_tokens"]
            else 0.0
            for side in (a, b)
        ]
        rounds.append(
            {
                "round": r,
                "A": a,
                "B": b,
                "ratio": b["tokens_per_s"] / a["tokens_per_s"],
                "acceptance_without": acceptance[0],
                "acceptance_with": acceptance[1],
            }
        )
        print(
            f"  round {r}: ratio {rounds[-1]['ratio']:.4f}, acceptance "
            f"{acceptance[0]:.3f} without / {acceptance[1]:.3f} with states",
            flush=True,
        )
    method = speculative_config["method"]
    summary = summarize(
        [r["ratio"] for r in rounds],
        f"throughput with states ({len(four_layers(sizes))} layers, prompt+output) "
        f"/ without, {method} speculation on (acceptance per side in rounds)",
        True,
        0.97,
    )
    result = engine_result(
        name,
        (doc or "").split("\n\n")[0].replace("\n    ", " "),
        settings,
        rounds,
        summary,
        memory={"without states": out["plain"], "with states": out["states"]},
        speculative_config=speculative_config,
    )
    return [result]
