"""Test servers and the checks of their responses, in three parts:

- `process`: real `vllm serve` processes of the patched install (`ServerProcess`)
  and the test servers' settings (`HS_CONFIG`, the refs server's `REFS_*`).
- `parsing`: responses and SSE streams read back by choice (`collect_response`,
  `collect_stream`, `Collected`).
- `checks`: every row of a collected response against HF transformers (`check`,
  `Want`).
"""

from vllm_hs_testing.server.checks import (
    DTYPE,
    Want,
    check,
    check_stream_timing,
    one_torch_thread,
    reference,
    resolve,
)
from vllm_hs_testing.server.parsing import (
    Collected,
    ask,
    collect_response,
    collect_stream,
    get,
    sse_chunks,
)
from vllm_hs_testing.server.process import (
    HS_CONFIG,
    REFS_API_KEY,
    REFS_MAX_BYTES,
    REFS_TTL_S,
    STARTUP_TIMEOUT_S,
    ServerProcess,
    free_port,
    send_signal,
)

__all__ = [
    "DTYPE",
    "HS_CONFIG",
    "REFS_API_KEY",
    "REFS_MAX_BYTES",
    "REFS_TTL_S",
    "STARTUP_TIMEOUT_S",
    "Collected",
    "ServerProcess",
    "Want",
    "ask",
    "check",
    "check_stream_timing",
    "collect_response",
    "collect_stream",
    "free_port",
    "get",
    "one_torch_thread",
    "reference",
    "resolve",
    "send_signal",
    "sse_chunks",
]
