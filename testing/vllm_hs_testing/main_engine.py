"""The main test engine's and test server's settings (tests/engine/conftest.py,
`server.process`): the tiny model's shape, the layer set they capture, and the
per-request cap, chunked-prefill budget and prefix store derived from it."""

from __future__ import annotations

# -1 resolves to L=4 of the tiny model (hidden size 128, fp32).
NUM_LAYERS = 4
MAIN_LAYERS: list[int | str] = [0, 2, -1, "final_norm"]
MAIN_RESOLVED: list[int | str] = [0, 2, 4, "final_norm"]
HIDDEN = 128
ROW_BYTES = len(MAIN_LAYERS) * HIDDEN * 4  # fp32
CAP_ROWS = 256
CAP_BYTES = CAP_ROWS * ROW_BYTES  # max_bytes_per_request of the main engine
BUDGET = 32  # max_num_batched_tokens: long prompts prefill in many chunks
PREFIX_STORE_BLOCKS = 4  # rows of 32-token blocks the main engine keeps
PREFIX_STORE_BYTES = PREFIX_STORE_BLOCKS * 32 * ROW_BYTES
