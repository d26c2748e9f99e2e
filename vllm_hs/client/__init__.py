"""Clients of a patched vLLM server's hidden states.

- `responses`: hidden states in OpenAI-compatible responses (the `openai`
  client's objects or raw JSON) back into tensors, references fetched.
- `speculators_online`: speculators' online training from a patched server,
  states by reference (``python -m vllm_hs.client.speculators_online``).

    from vllm_hs import client as hs
    states = hs.from_response(resp, server=openai_client)
"""

from vllm_hs.client.responses import (
    RefFetcher,
    ResponseHiddenStates,
    decode,
    from_response,
    from_stream,
    map_safetensors,
    sse_events,
)

__all__ = [
    "RefFetcher",
    "ResponseHiddenStates",
    "decode",
    "from_response",
    "from_stream",
    "map_safetensors",
    "sse_events",
]
