"""One benchmark workload in its own process: start an engine, run variants of
a batch alternately, print one JSON line of timings.

    python -m benchmarks.workload '<json spec>'

Runs under any vLLM install, patched or not (variants that ask for hidden states
need the patched one). Spec keys: model, engine (LLM kwargs), prompts (count),
prompt_len, max_tokens, rounds, variants ({name: hidden_states or null}),
mode ("mp" or "inproc"), memcpy_mib (0 to skip).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


class PeakRss:
    """Samples the resident memory of this process and its children."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.peak_total = 0
        self.peak_self = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                own = self._proc.memory_info().rss
                total = own + sum(
                    c.memory_info().rss for c in self._proc.children(recursive=True)
                )
            except Exception:
                continue
            self.peak_self = max(self.peak_self, own)
            self.peak_total = max(self.peak_total, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def memcpy_bandwidth(mib: int) -> float:
    """Bytes per second of a large tensor copy on this machine, best of 5."""
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best


def write_outputs(
    llm: Any, outs: list, spec: dict[str, Any], tag: str, tp: Any
) -> None:
    """Put each request's states on disk in the training-data layout
    (`hs_{i}.safetensors`: hidden_states [T, K, H], token_ids [T]).

    With the channel the states are in the outputs; with vLLM's native
    extract_hidden_states connector the files are written by the engine, the
    last ones only on a later engine step: step once more and wait for them.
    """
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import save_file
    from vllm import SamplingParams

    directory = Path(spec["write_dir"]) / tag
    if getattr(outs[0], "prompt_hidden_states", None) is not None:
        directory.mkdir(parents=True, exist_ok=True)
        for i, o in enumerate(outs):
            save_file(
                {
                    "hidden_states": o.prompt_hidden_states.contiguous(),
                    "token_ids": torch.tensor(o.prompt_token_ids, dtype=torch.int64),
                },
                str(directory / f"hs_{i}.safetensors"),
            )
    elif spec.get("native"):
        llm.generate(
            [tp(prompt_token_ids=[8, 9])], SamplingParams(max_tokens=1), use_tqdm=False
        )
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
        deadline = time.monotonic() + 300
        # A file is complete once it exists and its .lock is released.
        while not all(os.path.exists(p) and not _locked(p + ".lock") for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError("native connector did not write its files")
            time.sleep(0.002)
    shutil.rmtree(Path(spec["write_dir"]), ignore_errors=True)


def _locked(path: str) -> bool:
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
        "0" if spec["mode"] == "inproc" else "1"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(0)
    prompts = [
        TokensPrompt(
            prompt_token_ids=torch.randint(
                8, spec["vocab"], (spec["prompt_len"],), generator=g
            ).tolist()
        )
        for _ in range(spec["prompts"])
    ]

    def params(hidden_states: Any) -> Any:
        kwargs = {} if hidden_states is None else {"hidden_states": hidden_states}
        return SamplingParams(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            **kwargs,
        )

    t0 = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine"])
    start_s = time.perf_counter() - t0
    variants = spec["variants"]
    llm.generate(prompts[:2], params(None), use_tqdm=False)  # warm-up
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(spec["rounds"]):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            with PeakRss() as rss:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params(variants[name]), use_tqdm=False)
                if spec.get("write_dir"):
                    write_outputs(llm, outs, spec, f"{name}-{r}", TokensPrompt)
                wall = time.perf_counter() - t0
            tokens = sum(
                len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs
            )
            state_bytes = 0
            for o in outs:
                rows = getattr(o, "prompt_hidden_states", None)
                state_bytes += 0 if rows is None else rows.nbytes
                rows = getattr(o.outputs[0], "hidden_states", None)
                state_bytes += 0 if rows is None else rows.nbytes
            timings[name].append(
                {
                    "wall_s": wall,
                    "tokens_per_s": tokens / wall,
                    "state_bytes": state_bytes,
                    "state_bytes_per_s": state_bytes / wall,
                    "peak_rss_total": rss.peak_total,
                    "peak_rss_frontend": rss.peak_self,
                }
            )
            del outs
    result = {"start_s": start_s, "timings": timings}
    if spec.get("memcpy_mib"):
        result["memcpy_bytes_per_s"] = memcpy_bandwidth(spec["memcpy_mib"])
    llm.llm_engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    print("WORKLOAD_RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
