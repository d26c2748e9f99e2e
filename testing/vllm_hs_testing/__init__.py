"""Test support of vllm-hs: the vllm-hs-testing distribution (testing/), installed
where tests and benchmarks run (tox's tests and bench envs), never shipped in the
vllm-hs wheel nor imported by its product code.

- `engines`: engines for tests, in-process or multiprocess, cleaned up, their
  workers' model runner checked (`engine`), the engine modes and shared option
  sets (`MODES`, `NGRAM`, `PREEMPTING`), and what is read back from a running
  engine (`worker_request_ids`, `engine_metric`).
- `probe`: the worker extension `ChannelStateProbe` (re-exported here).
- `main_engine`: the layer set and limits of the main test engine and server.
- `requests`: requests tests send (`greedy`, `tokens_prompt`, `repeated_prompt`).
- `hf_checks`: a request's hidden-state rows against HF transformers (`Expect`,
  `check_output`, `run_cases`), shared by the engine tests.
- `speculative`: the requests and checks of the speculative-decoding tests.
- `server/`: real `vllm serve` processes (`process`), their responses read back
  (`parsing`) and checked against HF (`checks`).
- `architectures`: tiny seeded models of each architecture the channel supports
  (the conformance table of tests/engine/test_architectures.py).
- `extract_output`: reading back what `vllm-hs extract` wrote.
- `mooncake`: a Mooncake master for the tests and benchmarks of the ref store.
- `git`: a fixed git identity for the repositories tests build.

The product's seeded models (the tiny default with `seeded_prompt`, the
structured target, the EAGLE-3 draft) live in `vllm_hs.models`.

Worker processes load the probe by name,
`worker_extension_cls="vllm_hs_testing.ChannelStateProbe"`, importing this
package: nothing imported here imports torch or vLLM at module level.
"""

from vllm_hs_testing.engines import (
    check_model_runner,
    engine,
    expected_model_runner,
    poll_until_empty,
)
from vllm_hs_testing.probe import ChannelStateProbe

__all__ = [
    "ChannelStateProbe",
    "check_model_runner",
    "engine",
    "expected_model_runner",
    "poll_until_empty",
]
