"""Test support: never imported by vllm-hs's product code.

- `harness`: engines for tests (in-process or multiprocess, cleaned up, model
  runner checked), the worker probe `ChannelStateProbe`, the checks of
  hidden-state rows against HF transformers shared by engine and server tests,
  and the request tables several test modules share.
- `server/`: real `vllm serve` processes (`process`), their responses read back
  (`parsing`) and checked against HF (`checks`).
- `extract_output`: reading back what `vllm-hs extract` wrote.
- `git`: a fixed git identity for the repositories tests build.

Seeded models (the tiny default, the architectures' conformance models, the
structured target, the EAGLE-3 draft) live in `vllm_hs.models`.

`worker_extension_cls="vllm_hs.testing.ChannelStateProbe"` names the probe.
"""

from vllm_hs.testing.harness import (
    ChannelStateProbe,
    check_model_runner,
    engine,
    expected_model_runner,
    poll_until_empty,
)

__all__ = [
    "ChannelStateProbe",
    "check_model_runner",
    "engine",
    "expected_model_runner",
    "poll_until_empty",
]
