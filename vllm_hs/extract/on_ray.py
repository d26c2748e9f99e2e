"""`vllm-hs extract --ray`: the same extraction on a Ray cluster, one patched
engine per replica.

The driver (this process) does what a single-process run does before and after
the engine loop, with the same code (`vllm_hs.extract.job.prepare` and
`ExtractJob.finish`): it checks the options, opens the output directory and
writes its manifest, plans the samples (chat template, loss masks) and, with
--resume, finds the samples already written. The samples left go through a
Ray Data pipeline: `map_batches` over an actor pool of ``replicas`` actors,
each holding one engine and running the single-process engine loop
(`vllm_hs.extract.loop.run_samples`) on its batches. Replicas write each
sample file themselves, atomically, straight into the output directory (a file
system every node sees at the same path), and answer each batch with a
`BatchReport`: the rows written, the samples skipped and why, their time. The
driver advances one progress bar as reports arrive, then closes gaps and writes
the dataset and the manifest.

So the output is the dataset a single-process run writes (same rows in the same
order, same files, same manifest), and --resume continues a run killed at any
point, with or without Ray and with any number of replicas. A replica that
dies is restarted by Ray Data and its batch redone (rewritten files are
identical). Without a shared file system: run one shard per node
(--num-shards/--shard-index, each with --ray on its own node or without Ray),
copy the shard directories into one directory and --merge.

Ray is an optional dependency (the ``ray`` extra, `requirements/ray.txt`),
imported only here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import socket
import time
from collections.abc import Sequence
from typing import Any

from vllm_hs.errors import VllmHsError, import_extra
from vllm_hs.extract.engine import ModelFacts, start_engine
from vllm_hs.extract.inputs import Conversation, Sample
from vllm_hs.extract.job import prepare
from vllm_hs.extract.loop import LoopSettings, progress_bar, run_samples
from vllm_hs.extract.records import ExtractResult, Row, Skip
from vllm_hs.extract.settings import ExtractSettings, RayOptions

__all__ = ["BatchReport", "ReplicaStats", "extract_on_ray", "start_ray"]

logger = logging.getLogger(__name__)

#: Prefixes of the driver's environment variables the replicas get (vLLM's,
#: Hugging Face's and OpenMP's settings; vllm-hs's model cache).
FORWARDED_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "TOKENIZERS_")

#: Object store of a local cluster started for the run: only batch reports
#: travel through it (states go straight to files).
LOCAL_OBJECT_STORE_BYTES = 512 << 20


@dataclasses.dataclass
class ReplicaStats:
    """What one replica did in this run."""

    samples: int = 0
    tokens: int = 0
    """Tokens of the samples it wrote."""
    seconds: float = 0.0
    """Time it spent on its batches (engine loop and writes)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class BatchReport:
    """A replica's answer to one batch of samples."""

    replica: str
    """host:pid of the replica's actor."""
    samples: int
    rows: dict[int, Row]
    """Rows written (row -> its token ids and loss mask)."""
    skipped: list[Skip]
    tokens: int
    bytes: int
    seconds: float


class Replica:
    """A Ray Data actor (`map_batches` callable class): one patched engine,
    started once; each call extracts one batch of pickled `Sample`s."""

    def __init__(self, facts: ModelFacts, loop: LoopSettings) -> None:
        settings = loop.settings
        assert settings.model is not None
        self.llm = start_engine(
            settings.model, settings.engine_options or {}, settings.layers
        )
        differ = facts.differences(ModelFacts.of(self.llm.llm_engine.model_config))
        if differ:
            raise VllmHsError(
                f"replica on {socket.gethostname()}: its engine's model differs "
                f"from the driver's plan (driver, replica): {differ}; pass the "
                "engine options that settle it (e.g. --dtype, --max-model-len) or "
                "make the same model files visible on every node"
            )
        self.tokenizer = facts.load_tokenizer()
        self.loop = loop
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[bytes]]:
        samples: list[Sample] = [pickle.loads(b) for b in batch["sample"]]
        result = ExtractResult(output=self.loop.settings.output)
        rows: dict[int, Row] = {}
        started = time.perf_counter()
        run_samples(
            self.llm.llm_engine, self.tokenizer, self.loop, samples, result, rows
        )
        report = BatchReport(
            replica=self.name,
            samples=len(samples),
            rows=rows,
            skipped=result.skipped,
            tokens=result.written_tokens,
            bytes=result.bytes,
            seconds=time.perf_counter() - started,
        )
        return {"report": [pickle.dumps(report)]}


def start_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Connect to the Ray cluster at ``address`` ("auto", "ray://host:port",
    "host:port"), or start a local one for this run (None). Returns the `ray`
    module."""
    ray = import_extra("ray", "--ray", extra="ray")
    import_extra("ray.data", "--ray", extra="ray")
    env = {
        key: value
        for key, value in os.environ.items()
        if key.startswith(FORWARDED_ENV_PREFIXES) or key == "VLLM_HS_CACHE"
    }
    runtime_env = {"env_vars": env} if env else None
    if address is None:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=False,
        )
    else:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
    return ray


def extract_on_ray(
    conversations: Sequence[Conversation],
    settings: ExtractSettings,
    facts: ModelFacts | None = None,
) -> tuple[ExtractResult, dict[str, ReplicaStats]]:
    """Extract as `vllm_hs.extract.job.extract` does, with ``settings.ray``'s
    replicas, each an engine of ``settings.model`` with
    ``settings.engine_options`` (``settings.buffer_bytes`` holds per replica).
    ``facts``: the model as those engines will see it (default:
    `ModelFacts.planned`; replicas check they agree). Returns the result and
    what each replica did (keyed by host:pid).
    """
    ray_options = settings.ray or RayOptions()
    assert settings.model is not None
    engine_options = settings.engine_options or {}
    if facts is None:
        facts = ModelFacts.planned(settings.model, engine_options)
    job = prepare(facts, facts.load_tokenizer(), conversations, settings)
    stats: dict[str, ReplicaStats] = {}
    if isinstance(job, ExtractResult):
        return job, stats
    todo = job.todo
    replicas = ray_options.replicas
    batch_size = ray_options.batch_size
    if batch_size is None:
        batch_size = max(1, min(64, math.ceil(len(todo) / (4 * replicas))))
    started = time.perf_counter()
    if todo:
        ray = start_ray(
            ray_options.address, num_cpus=max(os.cpu_count() or 1, replicas)
        )
        try:
            _run_pipeline(
                ray,
                facts,
                job.loop,
                todo,
                job.result,
                job.rows,
                stats,
                replicas=replicas,
                batch_size=batch_size,
            )
        finally:
            ray.shutdown()
    job.result.seconds = time.perf_counter() - started
    job.finish()
    return job.result, stats


def _run_pipeline(
    ray: Any,
    facts: ModelFacts,
    loop: LoopSettings,
    todo: list[Sample],
    result: ExtractResult,
    rows: dict[int, Row],
    stats: dict[str, ReplicaStats],
    *,
    replicas: int,
    batch_size: int,
) -> None:
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.verbose_progress = False
    context.execution_options.preserve_order = False
    items = [{"sample": pickle.dumps(s)} for s in todo]
    gpus = _gpus_per_replica(ray, loop.settings.engine_options or {})
    dataset = ray.data.from_items(items).map_batches(
        Replica,
        fn_constructor_kwargs={"facts": facts, "loop": loop},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=replicas),
        num_cpus=1,
        num_gpus=gpus,
    )
    bar = progress_bar(len(todo), loop.settings.progress)
    started = time.perf_counter()
    try:
        for record in dataset.iter_rows():
            report: BatchReport = pickle.loads(record["report"])
            rows.update(report.rows)
            result.skipped.extend(report.skipped)
            result.written += len(report.rows)
            result.written_tokens += report.tokens
            result.bytes += report.bytes
            replica = stats.setdefault(report.replica, ReplicaStats())
            replica.samples += len(report.rows)
            replica.tokens += report.tokens
            replica.seconds += report.seconds
            for skip in report.skipped:
                logger.info("skipping conversation %d: %s", skip.index, skip.reason)
            bar.update(report.samples)
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(
                f"{result.written_tokens / elapsed:,.0f} tok/s, "
                f"{len(stats)}/{replicas} replicas reporting",
                refresh=False,
            )
    except ray.exceptions.RayError as e:
        raise VllmHsError(
            f"the Ray pipeline failed ({type(e).__name__}): {_root_cause(e)}; "
            "samples already written are kept: rerun with --resume"
        ) from e
    finally:
        bar.close()


def _gpus_per_replica(ray: Any, engine_kwargs: dict[str, Any]) -> float:
    """GPUs a replica reserves: its engine's world size where the cluster has
    GPUs, else none (CPU engines)."""
    if not ray.cluster_resources().get("GPU"):
        return 0
    return float(
        int(engine_kwargs.get("tensor_parallel_size") or 1)
        * int(engine_kwargs.get("pipeline_parallel_size") or 1)
    )


def _root_cause(error: BaseException) -> str:
    """The innermost message of a Ray error (a replica's VllmHsError reads
    as it would in a single-process run)."""
    cause = getattr(error, "cause", None) or error.__cause__
    while cause is not None:
        error = cause
        cause = getattr(error, "cause", None) or error.__cause__
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__
