"""`vllm_hs.triton_interpreter`: with its stand-in backend registered, Triton's
interpreter runs a kernel whose load mask is typed int1 but carries int32 data
(the pattern of Model Runner V2's `_ngram_finalize_kernel`), with the values
compiled Triton gives. Without the fix Triton 3.9.0's interpreter raises
"mask has unsupported dtype". In a subprocess: TRITON_INTERPRET is read when
Triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

KERNEL = textwrap.dedent(
    """
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    if sys.argv[1] == "registered":
        from vllm_hs.triton_interpreter import register
        assert register()
    import torch, triton, triton.language as tl

    @triton.jit
    def gather(x_ptr, n_ptr, out_ptr, K: tl.constexpr, KP: tl.constexpr):
        n = tl.load(n_ptr)
        i = tl.arange(0, KP).to(tl.int64)
        ok = (n > 0) & (tl.max(tl.load(x_ptr + i), axis=0) > 0)
        avail = tl.maximum(n.to(tl.int64) - 1, 0)
        mask = (i < avail) & ok & (i < K)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=mask, other=0), mask=i < K)

    x = torch.arange(1, 9, dtype=torch.int64)
    out = torch.full((8,), -1, dtype=torch.int64)
    gather[(1,)](x, torch.tensor([4], dtype=torch.int32), out, K=6, KP=8)
    print(out.tolist())
    """
)


def _run(variant: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", KERNEL, variant],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_int_data_under_a_bool_mask_type_loads_as_compiled_triton_does():
    result = _run("registered")
    assert result.returncode == 0, result.stderr[-2000:]
    # Rows below min(n - 1, K) loaded, the rest of K `other`, past K untouched.
    assert result.stdout.strip().splitlines()[-1] == "[1, 2, 3, 0, 0, 0, -1, -1]"


def test_without_the_stand_in_the_interpreter_refuses_that_mask():
    """Documents the Triton bug the stand-in works around: when this fails,
    Triton's interpreter handles such masks itself and `_bool_masks` can go."""
    result = _run("plain")
    assert result.returncode != 0
    assert "mask has unsupported dtype" in result.stderr
