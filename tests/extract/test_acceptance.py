"""The purpose, end to end: an EAGLE-3 draft trained (by speculators' own
trainer) on states from `vllm-hs extract --regenerate` is accepted by vLLM's
EAGLE-3 speculative decoding about as often as the same draft trained on HF
transformers' states of the same sequences. A wrong row (shifted layer or
position, zeros, another request's) trains a draft for states vLLM never
shows it, and its acceptance falls.

The loop of `benchmarks.suites.acceptance` at small settings: a structured target
trained for 500 steps (cached), 256 training conversations, 5 epochs, 16
held-out prompts. Every stage runs in its own process. With 3 epochs the HF
draft's acceptance sat at 0.25-0.32 depending on seed and machine (the floor
below is 0.3); with 5 it is 0.56-0.57 for seeds 0 and 1, and the untrained
draft's is about 0.006."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# `benchmarks` is not installed: appended so that vllm_hs still comes from the
# installed wheel under tox.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))


def test_vllm_hs_draft_is_accepted_like_the_hf_draft(tmp_path: Path) -> None:
    from benchmarks.suites.acceptance import AcceptanceSettings, run
    from vllm_hs.models.structured_target import build_structured_target

    settings = AcceptanceSettings(
        model=str(build_structured_target(steps=500)),
        train_conversations=256,
        eval_prompts=16,
        epochs=5,
        ways="vllm_hs,hf",
        work=str(tmp_path),
    )
    result = run(settings)
    hf = result["drafts"]["hf"]
    ours = result["drafts"]["vllm_hs"]
    # The target is structured enough and the draft learned it, or the
    # comparison below says nothing.
    assert hf["acceptance_rate"] > 0.3, result["drafts"]
    assert ours["draft_tokens"] > 0
    assert ours["acceptance_rate"] >= 0.9 * hf["acceptance_rate"], result["drafts"]
