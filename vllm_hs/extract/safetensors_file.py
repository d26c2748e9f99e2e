"""Write a safetensors file straight from the tensors' memory.

The layout (https://github.com/huggingface/safetensors#format): an 8-byte
little-endian header size N, N bytes of JSON header (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, padded
with spaces to a multiple of 8), then the tensors' bytes, back to back, in the
order of their offsets. Tensors go in the order safetensors itself uses (larger
elements first, then by name), so every tensor starts aligned to its element
size.

Why not ``safetensors.torch.save_file``: it writes through a temporary file of
its own, created private (0600), and renames it, inside the temporary file
`fs.atomic_path` already gives us, so each hs file cost two renames and a
chmod; the header's key order also follows a hash map. Here one ``open`` (the
umask's mode), one write per tensor from its own memory, and a header that is
the same bytes in every process. Readers: any safetensors binding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_CODES", "write_safetensors"]

#: torch dtype name -> the safetensors dtype code.
DTYPE_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def write_safetensors(
    path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` (CPU torch tensors, contiguous or not) to ``path``."""
    import torch

    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    data: list[memoryview] = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPE_CODES:
            raise ValueError(f"safetensors cannot hold {name} of dtype {dtype}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}, not the CPU")
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        size = flat.numel()
        header[name] = {
            "dtype": DTYPE_CODES[dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        data.append(memoryview(flat.numpy()))
        offset += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for view in data:
            f.write(view)
