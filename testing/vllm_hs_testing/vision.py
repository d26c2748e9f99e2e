"""The engine of the vision-language tests (tests/multimodal): its layers,
block size and prefix-row store, shared by the fixture and the tests."""

from __future__ import annotations

#: Every layer id of the tiny Qwen2.5-VL's 2 layers, and the final norm.
VL_LAYERS: list[int | str] = [0, 1, 2, "final_norm"]
#: KV block size: short prompts share whole blocks (the CPU default is 128;
#: CPU attention takes multiples of 32).
VL_BLOCK = 32
#: Bytes of the prefix-row store: 16 blocks of all four fp32 layers (hidden 64).
VL_STORE_BYTES = 16 * VL_BLOCK * len(VL_LAYERS) * 64 * 4
