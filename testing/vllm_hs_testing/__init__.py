"""Test support of vllm-hs: the vllm-hs-testing distribution (testing/), installed
where tests and benchmarks run (tox's tests and bench envs), never shipped in the
vllm-hs wheel nor imported by its product code.

- `harness`: engines for tests (in-process or multiprocess, cleaned up, model
  runner checked), the worker probe `ChannelStateProbe`, the checks of
  hidden-state rows against HF transformers shared by engine and server tests,
  and the request tables several test modules share.
- `server/`: real `vllm serve` processes (`process`), their responses read back
  (`parsing`) and checked against HF (`checks`).
- `architectures`: tiny seeded models of each architecture the channel supports
  (the conformance table of tests/engine/test_architectures.py).
- `extract_output`: reading back what `vllm-hs extract` wrote.
- `mooncake`: a Mooncake master for the tests and benchmarks of the ref store.
- `git`: a fixed git identity for the repositories tests build.

The product's seeded models (the tiny default, the structured target, the
EAGLE-3 draft) live in `vllm_hs.models`.

`worker_extension_cls="vllm_hs_testing.ChannelStateProbe"` names the probe.
"""

from vllm_hs_testing.harness import (
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
