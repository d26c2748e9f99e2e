"""One benchmark workload in its own process: start an engine, run variants of
a batch alternately, print one JSON line of timings.

    python -m benchmarks.workload '<json spec>'

Runs under any vLLM install, patched or not (variants that ask for hidden states
need the patched one). Spec keys: model, engine (LLM kwargs), prompts (count),
prompt_len, max_tokens, rounds, variants ({name: hidden_states or null}),
mode ("mp" or "inproc"), memcpy_mib (0 to skip), ipc_hop (bytes: time one
ZeroMQ IPC hop of that many bytes, one frame per prompt), peak_rss
(false: no memory sampling), warmup ("full" batch, the default, or "short"),
write_dir and native (write each request's states to disk; see
write_outputs), self_continue (prompts end with the model's own greedy continuation
of this many tokens), prompt_ids (these prompts, lists of token ids, instead of
seeded random ones) and spec_metrics (record each batch's speculative draft
and accepted tokens). Each timing records per-process peak memory
(benchmarks.peak_rss.PeakRss); the
result records the engine's effective settings and CPU threads (engine_facts).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from benchmarks.peak_rss import PeakRss


def engine_facts(llm: Any) -> dict[str, Any]:
    """The effective engine settings (after vLLM's own defaults and
    adjustments) and the CPU threads its processes were given: what a
    comparison between two engines must hold equal."""
    import psutil

    facts: dict[str, Any] = {}
    try:
        c = llm.llm_engine.vllm_config
        sc, cc, mc, cac = (
            c.scheduler_config,
            c.compilation_config,
            c.model_config,
            c.cache_config,
        )
        facts["config"] = {
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_seqs": sc.max_num_seqs,
            "enable_chunked_prefill": sc.enable_chunked_prefill,
            "async_scheduling": sc.async_scheduling,
            "enable_prefix_caching": cac.enable_prefix_caching,
            "block_size": cac.block_size,
            "num_kv_blocks": cac.num_gpu_blocks,
            "kv_cache_memory_bytes": getattr(cac, "kv_cache_memory_bytes", None),
            "dtype": str(mc.dtype),
            "max_model_len": mc.max_model_len,
            "enforce_eager": mc.enforce_eager,
            "compilation_mode": str(cc.mode),
            "cudagraph_mode": str(cc.cudagraph_mode),
            "executor": str(c.parallel_config.distributed_executor_backend),
            "speculative_method": getattr(c.speculative_config, "method", None),
            "kv_connector": getattr(c.kv_transfer_config, "kv_connector", None),
            # The channel's config (`LLM(hidden_states_config=...)`): an
            # AuxOutput kind; None on an unpatched wheel.
            "hidden_states_config": str(
                getattr(getattr(c, "aux_output_config", None), "hidden_states", None)
            ),
        }
    except Exception as e:  # a release with other config names
        facts["config_error"] = repr(e)
    processes = []
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                env = dict(
                    item.split(b"=", 1)
                    for item in f.read().split(b"\0")
                    if b"=" in item
                )
            cpus = sorted(
                {cpu for t in p.threads() for cpu in os.sched_getaffinity(t.id)}
            )
        except (OSError, psutil.Error):
            continue
        processes.append(
            {
                "name": p.name(),
                "omp_num_threads": env.get(b"OMP_NUM_THREADS", b"").decode() or None,
                "cpus": cpus,
            }
        )
    facts["processes"] = processes
    facts["env"] = {
        k: v for k, v in os.environ.items() if k.startswith(("VLLM_CPU_", "OMP_"))
    }
    return facts


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


def _ipc_hop_receiver(address: str, rounds: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(address)
    for _ in range(rounds):
        frames = sock.recv_multipart(copy=False)
        del frames
        sock.send(b"k")
    sock.close(linger=0)


def ipc_hop_seconds(nbytes: int, frames: int, rounds: int = 10) -> float:
    """Seconds for one ZeroMQ IPC hop of `nbytes` in `frames` frames between
    two processes (sent without a copy, received into the receiver's own
    buffers, as vLLM sends engine outputs): median of `rounds` messages, each
    timed until the receiver acknowledges it."""
    import multiprocessing
    import statistics
    import tempfile

    import numpy as np
    import zmq

    address = f"ipc://{tempfile.mktemp(prefix='vllm-hs-hop-')}"
    sock = zmq.Context().socket(zmq.PAIR)
    sock.bind(address)
    child = multiprocessing.get_context("spawn").Process(
        target=_ipc_hop_receiver, args=(address, rounds + 1)
    )
    child.start()
    size = max(nbytes // frames, 1)
    payload = [np.ones(size, dtype=np.uint8) for _ in range(frames)]
    times = []
    for r in range(rounds + 1):  # the first one connects and warms up
        t0 = time.perf_counter()
        sock.send_multipart([memoryview(b) for b in payload], copy=False)
        sock.recv()
        if r:
            times.append(time.perf_counter() - t0)
    child.join()
    sock.close(linger=0)
    return statistics.median(times)


def write_outputs(llm: Any, outs: list, spec: dict[str, Any], tag: str) -> None:
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
        wait_native_files(llm, outs)
    shutil.rmtree(Path(spec["write_dir"]), ignore_errors=True)


def wait_native_files(llm: Any, outs: list) -> list[str]:
    """The files vLLM's native extract_hidden_states connector writes for
    `outs`, once complete: the last ones come only on a later engine step, so
    step once more, then wait for each file and the release of its .lock."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate(
        [TokensPrompt(prompt_token_ids=[8, 9])],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    deadline = time.monotonic() + 300
    while not all(os.path.exists(p) and not _locked(p + ".lock") for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError("native connector did not write its files")
        time.sleep(0.002)
    return paths


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


def _spec_counts(llm: Any) -> tuple[float, float]:
    """(draft tokens, accepted tokens) proposed so far (speculative decoding;
    needs the engine's stats: disable_log_stats=False)."""
    counts = {
        "vllm:spec_decode_num_draft_tokens": 0.0,
        "vllm:spec_decode_num_accepted_tokens": 0.0,
    }
    for metric in llm.get_metrics():
        if metric.name in counts:
            counts[metric.name] += float(getattr(metric, "value", 0) or 0)
    return (
        counts["vllm:spec_decode_num_draft_tokens"],
        counts["vllm:spec_decode_num_accepted_tokens"],
    )


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
    if spec.get("prompt_ids"):
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompt_ids"]]

    def params(hidden_states: Any) -> Any:
        kwargs = {} if hidden_states is None else {"hidden_states": hidden_states}
        return SamplingParams(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            **kwargs,
        )

    ipc_hop_s = None
    if spec.get("ipc_hop"):
        # Before the engine starts: the hop alone on the machine.
        ipc_hop_s = ipc_hop_seconds(int(spec["ipc_hop"]), spec["prompts"], rounds=20)
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **spec["engine"])
    start_s = time.perf_counter() - t0
    facts = engine_facts(llm)
    variants = spec["variants"]
    if spec.get("self_continue"):
        # Prompts end with the model's own greedy continuation (the last
        # self_continue tokens): where a model repeats itself, so does what it
        # generates next, and ngram drafts are accepted.
        k = int(spec["self_continue"])
        heads = [p["prompt_token_ids"][: spec["prompt_len"] - k] for p in prompts]
        cont = SamplingParams(
            temperature=0.0, max_tokens=k, ignore_eos=True, detokenize=False
        )
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=h) for h in heads], cont, use_tqdm=False
        )
        prompts = [
            TokensPrompt(prompt_token_ids=h + list(o.outputs[0].token_ids))
            for h, o in zip(heads, outs, strict=True)
        ]
    # Warm-up with the full batch: the first batch of a new size pays one-off
    # costs (kernel selection, buffers) that no measured round should carry.
    warm = prompts if spec.get("warmup", "full") == "full" else prompts[:2]
    outs = llm.generate(warm, params(None), use_tqdm=False)
    if spec.get("write_dir"):
        write_outputs(llm, outs, spec, "warmup")
    del outs
    timings: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(spec["rounds"]):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            # The sampler's thread costs the frontend's core a little CPU; a
            # figure that needs no memory can run without it (peak_rss false).
            rss = PeakRss() if spec.get("peak_rss", True) else None
            drafts = _spec_counts(llm) if spec.get("spec_metrics") else None
            with rss or contextlib.nullcontext():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params(variants[name]), use_tqdm=False)
                generate_s = time.perf_counter() - t0
                if spec.get("write_dir"):
                    write_outputs(llm, outs, spec, f"{name}-{r}")
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
                    "generate_s": generate_s,
                    "write_s": wall - generate_s,
                    "tokens_per_s": tokens / wall,
                    "generate_tokens_per_s": tokens / generate_s,
                    "state_bytes": state_bytes,
                    "state_bytes_per_s": state_bytes / wall,
                    **(rss.fields() if rss else {}),
                }
            )
            if drafts is not None:
                after = _spec_counts(llm)
                timings[name][-1]["draft_tokens"] = after[0] - drafts[0]
                timings[name][-1]["accepted_tokens"] = after[1] - drafts[1]
            del outs
    result = {"start_s": start_s, "timings": timings, "engine": facts}
    llm.llm_engine.engine_core.shutdown()
    if spec.get("memcpy_mib"):
        result["memcpy_bytes_per_s"] = memcpy_bandwidth(spec["memcpy_mib"])
    if ipc_hop_s is not None:
        result["ipc_hop_s"] = ipc_hop_s
    return result


if __name__ == "__main__":
    print("WORKLOAD_RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
