"""Write a safetensors file straight from the tensors' memory, and map one.

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
import mmap
import sys
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_CODES", "map_safetensors", "write_safetensors"]

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

#: safetensors dtype code -> torch dtype name.
_DTYPES = {code: name for name, code in DTYPE_CODES.items()}


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


def map_safetensors(path: str | Path) -> dict[str, Any]:
    """The tensors of a safetensors file, mapped (copy-on-write) instead of
    read: no copy of the data, and the mapping outlives the file's deletion."""
    import torch

    with open(path, "rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(header_len))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        shape = [int(n) for n in entry["shape"]]
        if end == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        data = torch.frombuffer(
            mapped, dtype=torch.uint8, offset=start + begin, count=end - begin
        )
        if sys.byteorder != "little" and dtype.itemsize > 1:
            data = data.reshape(-1, dtype.itemsize).flip(1).reshape(-1)
        tensors[name] = data.view(dtype).reshape(shape)
    return tensors
