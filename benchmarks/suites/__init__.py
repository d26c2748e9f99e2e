"""Every benchmark suite, by name: its sides, settings and measure function
(`python -m benchmarks list` prints them).

Engine suites share `EngineSettings` (the batch, model, rounds and engine
options) and run each measurement in a `benchmarks.workload` process; the
others (extraction, gather, storage, prefix_store, ray_extract, payload, ref_store,
response_encoding, acceptance, acceptance_vl) have settings of their own. What
each figure compares is in its module's text and in its result file's description.
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.protocol import Suite
from benchmarks.result import Result
from benchmarks.suites import (
    acceptance,
    acceptance_vl,
    extraction,
    gather,
    generation,
    hot_path,
    native,
    payload,
    prefix_store,
    ray_extract,
    ref_store,
    response_encoding,
    speculation,
    storage,
    throughput,
    transport,
)
from benchmarks.suites.engine import EngineSettings

STATES = ("without states", "with states")


def _engine(
    name: str,
    about: str,
    sides: tuple[str, ...],
    measure: Callable[[EngineSettings], list[Result]],
) -> Suite:
    return Suite(name, about, sides, EngineSettings, measure)


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        _engine(
            "memory",
            "engine-core peak memory growth under one long prompt-states request "
            "against its bound",
            STATES,
            transport.memory,
        ),
        _engine(
            "overhead",
            "patched wheel (no hidden_states_config) against the unpatched wheel",
            ("unpatched", "patched"),
            throughput.overhead,
        ),
        _engine(
            "overhead_config",
            "patched engine with hidden_states_config, requests asking nothing, "
            "against the unpatched wheel",
            ("unpatched", "patched"),
            throughput.overhead_config,
        ),
        _engine(
            "capture",
            "generation with 4 layers' prompt and output states against without",
            STATES,
            generation.capture,
        ),
        _engine(
            "decode",
            "decode-heavy generation with output states against without",
            STATES,
            generation.decode,
        ),
        _engine(
            "transport",
            "prefill with every layer's states: added wall time per byte against "
            "memcpy (transport) and throughput (heavy_payload)",
            STATES,
            transport.transport,
        ),
        _engine(
            "probe",
            "prefill with last-position states against without and all rows",
            ("without states", "all rows", "last position"),
            generation.probe,
        ),
        _engine(
            "speculative",
            "ngram speculative decoding with states against without",
            STATES,
            speculation.speculative,
        ),
        _engine(
            "eagle3",
            "EAGLE-3 speculative decoding with states against without (--model tiny)",
            STATES,
            speculation.eagle3,
        ),
        *(
            _engine(
                name,
                "extraction to disk, the channel against vLLM's native connector: "
                + native.NATIVE_BINDINGS[name][1].split(":")[0],
                ("native", "channel"),
                getattr(native, name),
            )
            for name in ("native", "native_omp_all", "native_default")
        ),
        _engine(
            "runner",
            "plain generation on Model Runner V2 against V1",
            ("v1", "v2"),
            throughput.runner,
        ),
        Suite(
            "extraction",
            "vllm-hs extract against plain prefill on one engine, and against HF "
            "transformers",
            ("extract", "states", "plain", "hf"),
            extraction.ExtractionSettings,
            extraction.measure,
        ),
        Suite(
            "hot_path",
            "the channel's own output path of a step's rows (worker, pickling to "
            "the engine core): before and after",
            ("before", "after"),
            hot_path.HotPathSettings,
            hot_path.measure,
        ),
        Suite(
            "gather",
            "the worker's gather of a step's rows (vLLM's prepare) against "
            "index_select + stack, at an 8B shape",
            ("index_select + stack", "prepare"),
            gather.GatherSettings,
            gather.measure,
        ),
        Suite(
            "storage",
            "hs file bytes and error per --storage-dtype",
            storage.STORAGES,
            storage.StorageSettings,
            storage.measure,
        ),
        Suite(
            "prefix_store",
            "prefix-cache hits served from the AuxOutput store against recomputing",
            ("recompute", "store"),
            prefix_store.PrefixStoreSettings,
            prefix_store.measure,
        ),
        Suite(
            "ray_extract",
            "vllm-hs extract --ray with 1 and 2 replicas against without Ray",
            tuple(ray_extract.SIDES),
            ray_extract.RayExtractSettings,
            ray_extract.measure,
        ),
        Suite(
            "payload",
            "large prompt-state responses through vllm serve: base64 against "
            "references over HTTP and by path; /health meanwhile",
            payload.WAYS,
            payload.PayloadSettings,
            payload.measure,
        ),
        Suite(
            "ref_store",
            "references from the server's store to a reader process, per store "
            "(shm, Mooncake), against memcpy",
            ref_store.WAYS,
            ref_store.RefStoreSettings,
            ref_store.measure,
        ),
        Suite(
            "response_encoding",
            "the server's base64 and float encoders and the client's decoder",
            response_encoding.VARIANTS,
            response_encoding.EncodingSettings,
            response_encoding.measure,
        ),
        Suite(
            "acceptance",
            "EAGLE-3 drafts trained on each way's states, served by vLLM",
            acceptance.DRAFTS,
            acceptance.AcceptanceSettings,
            acceptance.measure,
        ),
        Suite(
            "acceptance_vl",
            "the acceptance drafts on a vision-language target, image prompts",
            acceptance_vl.DRAFTS,
            acceptance_vl.AcceptanceVLSettings,
            acceptance_vl.measure,
        ),
    )
}

DEFAULT_SUITES = ("capture", "transport", "native", "overhead", "overhead_config")
"""What `python -m benchmarks run` measures when no suite is named."""
