"""Large hidden-state payloads through the patched OpenAI-compatible server.

One prompt whose prompt states (4 layer ids of an 8B-wide model, bf16) make a
tensor of ``--size-mib`` MiB (256 by default) is sent to a real `vllm serve`,
round after round, each round taking every way of getting the tensor, in an
order that rotates from round to round:

* ``none``: the same request without hidden states (the compute floor);
* ``base64``: ``"encoding": "base64"``, the rows inline in the JSON body;
* ``ref_http``: ``"encoding": "ref"``, then ``GET <url>`` (a safetensors file);
* ``ref_path``: the same, the client reading the reference's ``path`` (the
  server keeps references as files in a tmpfs directory: the co-located path).

Each way's time runs from sending the request to holding the tensor (decoded
with `vllm_hs.client`); its delivery rate is the tensor's bytes over the time
beyond ``none`` in the same round, and for references the fetch rate is the
tensor's bytes over the time from the response to the tensor. Every way ends
with a copy of the tensor (``clone``), so that a file mapped by safetensors
(the co-located path) is read, not only mapped. Meanwhile a separate process
asks ``/health`` every 20 ms; the longest answer during each way's requests says
how long the server's event loop was held (aim: under 100 ms while a 256 MiB
response is built). The model is a seeded Llama as wide as an 8B model (4096)
but with one attention head and two layers, so that the prompt's compute is
small beside the payload.

    python -m benchmarks run payload [--size-mib 256] [--rounds 3] [--quick]

Results: benchmarks/results/<release>/payload_*.json (one figure each, every
round kept), and the generated table.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.protocol import option
from benchmarks.result import Result, summarize
from benchmarks.rounds import run_rounds

WAYS = ("none", "base64", "ref_http", "ref_path")
LAYERS: list[int | str] = [0, 1, 2, "final_norm"]
MODEL = {
    "hidden_size": 4096,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "vocab_size": 1024,
}
HEALTH_INTERVAL_S = 0.02
HEALTH_AIM_MS = 100.0

POLLER = textwrap.dedent(
    """
    import sys, time, http.client
    host, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    interval = float(sys.argv[4])
    conn = http.client.HTTPConnection(host, port, timeout=30)
    with open(out, "w", buffering=1) as f:
        while True:
            start = time.time()
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            except Exception:
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=30)
            f.write(f"{start} {time.perf_counter() - t0}\\n")
            time.sleep(max(0.0, interval - (time.perf_counter() - t0)))
    """
)


@dataclass
class PayloadSettings:
    size_mib: int = option(256, "MiB of prompt states per response")
    rounds: int = option(3, "")
    quick: bool = option(
        False,
        "the smallest settings each suite offers: a smoke run (payload: 64 MiB, "
        "2 rounds; response_encoding: rows up to 256, 3 rounds, short timings; "
        "acceptance: about 10 minutes)",
    )

    def __post_init__(self) -> None:
        if self.quick:
            self.size_mib = min(self.size_mib, 64)
            self.rounds = min(self.rounds, 2)


def prompt_tokens(size_mib: int) -> int:
    row_bytes = len(LAYERS) * MODEL["hidden_size"] * 2  # bf16
    return (size_mib << 20) // row_bytes


def request_body(ids: list[int], way: str) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    if way != "none":
        encoding = "base64" if way == "base64" else "ref"
        body["hidden_states"] = {
            "layers": LAYERS,
            "prompt": True,
            "output": False,
            "encoding": encoding,
        }
    return body


def fetch(url: str, ids: list[int], way: str) -> tuple[float, float, int]:
    """(seconds from request to tensor, of them the seconds from the response
    to the tensor, tensor bytes) for one way."""
    import httpx

    from vllm_hs.client import RefFetcher, from_response

    start = time.perf_counter()
    reply = httpx.post(
        f"{url}/v1/completions", json=request_body(ids, way), timeout=600
    )
    reply.raise_for_status()
    data = reply.json()
    answered = time.perf_counter()
    if way == "none":
        return answered - start, 0.0, 0
    fetcher = RefFetcher(url, local=way == "ref_path")
    states = from_response(data, server=fetcher)
    rows = states.prompt(0)
    assert rows is not None
    rows = rows.clone()  # every byte read (a mapped file included)
    end = time.perf_counter()
    assert rows.shape == (len(ids), len(LAYERS), 4096), (way, rows.shape)
    if way != "base64":
        fetcher.delete(data["choices"][0]["prompt_hidden_states"]["url"])
    return end - start, end - answered, rows.numel() * rows.element_size()


def _timed(url: str, ids: list[int], way: str) -> Callable[[], dict[str, Any]]:
    """One way, timed: its `fetch` figures and the wall-clock window of its
    request (for the /health answers inside it)."""

    def timed() -> dict[str, Any]:
        started = time.time()
        seconds, fetch_s, nbytes = fetch(url, ids, way)
        return {
            "seconds": seconds,
            "after_response_s": fetch_s,
            "bytes": nbytes,
            "window": [started, time.time()],
        }

    return timed


def health_windows(
    samples: list[tuple[float, float]], windows: list[tuple[float, float]]
) -> list[float]:
    """Longest /health answer (ms) among those started in each window."""
    out = []
    for start, end in windows:
        inside = [lat for t, lat in samples if start <= t <= end]
        out.append(max(inside) * 1000 if inside else float("nan"))
    return out


def measure(args: PayloadSettings) -> list[Result]:
    from vllm_hs.models.tiny import build_tiny_model
    from vllm_hs_testing.server import ServerProcess

    tokens = prompt_tokens(args.size_mib)
    model = build_tiny_model(
        "llama", "bfloat16", max_position_embeddings=tokens + 64, **MODEL
    )
    work = Path(tempfile.mkdtemp(prefix="hs-payload-"))
    ref_dir = Path(tempfile.mkdtemp(prefix="hs-refs-", dir="/dev/shm"))
    config = {"layers": LAYERS, "max_bytes_per_request": 2 << 30}
    server = ServerProcess(
        str(model),
        work / "server.log",
        config,
        extra_args=[
            "--max-model-len",
            str(tokens + 16),
            "--max-num-batched-tokens",
            "2048",
            "--hidden-states-ref-store-config",
            json.dumps({"directory": str(ref_dir)}),
            "--no-enable-prefix-caching",
        ],
    )
    # ServerProcess serves float32; this payload is bf16, as an 8B model's.
    server.cmd[server.cmd.index("--dtype") + 1] = "bfloat16"
    health_log = work / "health.txt"
    server.start().wait_ready(timeout=600)
    poller = None
    try:
        ids = [(i * 7919) % (MODEL["vocab_size"] - 2) + 1 for i in range(tokens)]
        for way in WAYS:  # warm-up
            fetch(server.url, ids[:64], way)
        poller = subprocess.Popen(
            [
                sys.executable,
                "-c",
                POLLER,
                "127.0.0.1",
                str(server.port),
                str(health_log),
                str(HEALTH_INTERVAL_S),
            ]
        )
        ways = {way: _timed(server.url, ids, way) for way in WAYS}
        rounds = []
        for r, row in enumerate(run_rounds(args.rounds, ways)):
            rounds.append({"order": list(row), **row})
            for way, entry in row.items():
                print(f"round {r} {way}: {entry['seconds']:.3f} s", flush=True)
    finally:
        if poller is not None:
            poller.terminate()
            poller.wait(timeout=10)
        server.stop()
    samples = []
    for line in health_log.read_text().splitlines():
        start_s, latency_s = line.split()
        samples.append((float(start_s), float(latency_s)))
    for row in rounds:
        floor = row["none"]["seconds"]
        for way in WAYS:
            entry = row[way]
            [entry["health_max_ms"]] = health_windows(samples, [entry["window"]])
            if way != "none":
                extra = max(entry["seconds"] - floor, 1e-9)
                entry["delivery_mib_per_s"] = entry["bytes"] / extra / (1 << 20)
            if way.startswith("ref"):
                entry["fetch_mib_per_s"] = (
                    entry["bytes"] / entry["after_response_s"] / (1 << 20)
                )
        row["ref_http_over_base64"] = (
            row["ref_http"]["delivery_mib_per_s"] / row["base64"]["delivery_mib_per_s"]
        )
        row["ref_path_over_ref_http"] = (
            row["ref_path"]["fetch_mib_per_s"] / row["ref_http"]["fetch_mib_per_s"]
        )
    settings = {
        "model": "wide (seeded Llama, 4096 wide, 2 layers, 1 head, bf16)",
        "model_shape": MODEL,
        "prompt_tokens": tokens,
        "layers": LAYERS,
        "payload_mib": args.size_mib,
        "rounds": args.rounds,
        "health_interval_s": HEALTH_INTERVAL_S,
        "ref_dir": "tmpfs (/dev/shm)",
        "max_num_batched_tokens": 2048,
    }

    def result(suite: str, description: str, values: list[float], **summary: Any):
        return Result(
            suite=suite,
            description=description,
            settings=settings,
            rounds=rounds,
            summary=summarize(values, **summary),
        )

    health = [
        max(row[way]["health_max_ms"] for way in ("base64", "ref_http", "ref_path"))
        for row in rounds
    ]
    _print_rates(rounds)
    return [
        result(
            "payload_ref_http",
            f"{args.size_mib} MiB of prompt states: delivery rate (tensor bytes "
            "over the time beyond the same request without states) of "
            '"encoding": "ref" fetched over HTTP, against base64 inline',
            [row["ref_http_over_base64"] for row in rounds],
            metric="delivery rate ref over HTTP / base64 inline",
            higher_is_better=True,
            aim=None,
        ),
        result(
            "payload_ref_path",
            f"{args.size_mib} MiB by reference: the fetch rate (tensor bytes over "
            "the time from the response to the tensor) of the co-located path "
            "(the client reads the reference's file in the server's tmpfs "
            "directory) against GET",
            [row["ref_path_over_ref_http"] for row in rounds],
            metric="fetch rate co-located path / ref over HTTP",
            higher_is_better=True,
            aim=None,
        ),
        result(
            "payload_health",
            f"longest /health answer (ms, asked every 20 ms from another process) "
            f"while {args.size_mib} MiB responses are built and sent (base64, "
            "ref), per round",
            health,
            metric="longest /health answer, ms",
            higher_is_better=False,
            aim=HEALTH_AIM_MS,
        ),
    ]


def _print_rates(rounds: list[dict[str, Any]]) -> None:
    for way in WAYS[1:]:
        rates = [row[way]["delivery_mib_per_s"] for row in rounds]
        line = f"{way}: {statistics.median(rates):.0f} MiB/s delivery"
        if way.startswith("ref"):
            fetched = [row[way]["fetch_mib_per_s"] for row in rounds]
            line += f", {statistics.median(fetched):.0f} MiB/s fetch"
        print(line + " (medians)")
    print(json.dumps({w: [r[w]["seconds"] for r in rounds] for w in WAYS}))
