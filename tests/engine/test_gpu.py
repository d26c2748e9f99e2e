"""The channel on CUDA, on Model Runner V2 (vLLM's GPU default: rows copied on
`AsyncOutput`'s output copy stream with the step's other outputs), with async
scheduling and CUDA graphs on, checked against HF. Skipped without CUDA; run it
on a GPU machine with the patched CUDA wheel (`vllm-hs wheel --vllm
vllm==0.32.0`)."""

from __future__ import annotations

import pytest
import torch

from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import MODES, engine, worker_request_ids
from vllm_hs_testing.hf_checks import Expect, run_cases
from vllm_hs_testing.requests import greedy, tokens_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Engine options of every CUDA test: a small share of the GPU, vLLM's own KV
# cache sizing (`vllm_hs_testing.engine`'s default is the CPU one).
CUDA_ENGINE = dict(
    max_num_batched_tokens=64, gpu_memory_utilization=0.3, kv_cache_memory_bytes=None
)


@pytest.fixture(params=["v2"])
def runner(request, monkeypatch) -> str:
    """The model runner of the test's engines (V2, the default on CUDA; hidden
    states are an AuxOutput kind, which needs it)."""
    import vllm.envs

    flag = "1" if request.param == "v2" else "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", flag)
    vllm.envs.disable_envs_cache()  # an earlier in-process engine cached them
    yield request.param
    vllm.envs.disable_envs_cache()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_channel_on_cuda(mode, dtype, runner):
    from vllm_hs.models.tiny import build_tiny_model

    model_dir = str(build_tiny_model("llama", dtype))
    layers = [0, 2, -1, "final_norm"]
    with engine(
        model_dir,
        mode,
        hidden_states_config={"layers": layers},
        enable_prefix_caching=True,
        **CUDA_ENGINE,
    ) as llm:
        config = llm.llm_engine.vllm_config
        assert config.use_v2_model_runner == (runner == "v2")
        assert config.scheduler_config.async_scheduling
        assert config.compilation_config.cudagraph_mode != 0
        resolved = [0, 2, 4, "final_norm"]
        shared = seeded_prompt(403, 64)
        what = f"[cuda {runner} {mode}]"
        cases = [
            (seeded_prompt(400, 150), greedy(12, hidden_states={}), Expect(resolved)),
            (seeded_prompt(401, 20), greedy(12), None),
            (
                seeded_prompt(402, 33),
                greedy(9, hidden_states={"layers": ["final_norm", 0], "prompt": False}),
                Expect(["final_norm", 0], prompt=False),
            ),
            (shared + [9, 10], greedy(5, hidden_states={}), Expect(resolved)),
        ]
        # GPU kernels (TF32, fused ops) differ from HF on CPU more than fp32
        # CPU kernels do: compare with the bf16 tolerance.
        run_cases(llm, cases, model_dir, dtype, what, torch.bfloat16)
        # The shared prefix's rows are stored now: a prefix-cache hit with
        # prompt states, served from the store.
        hit = [(shared + [11, 12], greedy(5, hidden_states={}), Expect(resolved))]
        (out,) = run_cases(llm, hit, model_dir, dtype, f"{what} hit", torch.bfloat16)
        assert out.num_cached_tokens > 0


@pytest.mark.parametrize("name", ["mixtral", "gpt2"])
def test_generic_capture_with_cuda_graphs(name, runner):
    """Models without SupportsEagle3: the generic capture's static buffers
    under torch.compile and CUDA graphs (full and piecewise), every layer id,
    against HF."""
    from transformers import AutoConfig

    from vllm_hs_testing.architectures import build_architecture_model

    model_dir = str(build_architecture_model(name))
    num_layers = AutoConfig.from_pretrained(model_dir).get_text_config()
    layers = [*range(num_layers.num_hidden_layers + 1), "final_norm"]
    with engine(
        model_dir,
        "mp",
        skip_tokenizer_init=True,
        dtype="float32",
        hidden_states_config={"layers": layers},
        **CUDA_ENGINE,
    ) as llm:
        config = llm.llm_engine.vllm_config
        assert config.aux_output_config.hidden_states.generic_capture
        assert config.compilation_config.cudagraph_mode != 0
        cases = [
            (
                seeded_prompt(410 + i, 20 + 17 * i),
                greedy(10, hidden_states={}, detokenize=False),
                Expect(layers),
            )
            for i in range(3)
        ]
        run_cases(llm, cases, model_dir, "float32", f"[cuda {name}]", torch.bfloat16)


def test_channel_under_the_ray_executor(runner):
    """vLLM's Ray executor (`distributed_executor_backend="ray"`, a local Ray
    cluster; tensor parallel over two GPUs where there are two): rows equal HF,
    and requests aborted mid-flight leave nothing behind in the workers.

    CUDA only: vLLM 0.32's CPU platform has no Ray device key (`ray_utils`
    raises "current platform cpu does not support ray"; upstream issue #21602,
    PR #25386 closed unmerged)."""
    pytest.importorskip("ray")
    from vllm_hs.models.tiny import build_tiny_model

    model_dir = str(build_tiny_model("llama", "float32"))
    layers = [0, 2, -1, "final_norm"]
    resolved = [0, 2, 4, "final_norm"]
    tp = min(2, torch.cuda.device_count())
    with engine(
        model_dir,
        "mp",
        dtype="float32",
        hidden_states_config={"layers": layers},
        distributed_executor_backend="ray",
        tensor_parallel_size=tp,
        **CUDA_ENGINE,
    ) as llm:
        config = llm.llm_engine.vllm_config
        assert config.parallel_config.distributed_executor_backend == "ray"
        what = f"[cuda ray tp={tp} {runner}]"
        cases = [
            (seeded_prompt(420, 90), greedy(8, hidden_states={}), Expect(resolved)),
            (seeded_prompt(421, 20), greedy(8), None),
            (
                seeded_prompt(422, 40),
                greedy(6, hidden_states={"layers": [0], "prompt": False}),
                Expect([0], prompt=False),
            ),
        ]
        run_cases(llm, cases, model_dir, "float32", what, torch.bfloat16)
        llm_engine = llm.llm_engine
        ids = [f"ray-abort-{i}" for i in range(16)]
        for i, req_id in enumerate(ids):
            llm_engine.add_request(
                req_id,
                tokens_prompt(seeded_prompt(430 + i, 60)),
                greedy(40, hidden_states={}),
            )
        for _ in range(4):
            llm_engine.step()
        llm_engine.abort_request(ids)
        while llm_engine.has_unfinished_requests():
            llm_engine.step()
        assert not llm_engine.output_processor.request_states
        held = worker_request_ids(llm, "mp")
        assert held == [], f"{what} workers kept aborted requests"
        run_cases(
            llm, cases[:1], model_dir, "float32", f"{what} after aborts", torch.bfloat16
        )


def test_eagle3_speculation_on_cuda(runner):
    """EAGLE-3 speculation with states (the tiny draft of
    `vllm_hs.models.eagle3_draft`), async scheduling and CUDA graphs: rows of
    accepted tokens equal HF on the final sequence, in a batch mixing requests
    with and without states; drafts both accepted and rejected."""
    from vllm_hs.models.eagle3_draft import build_eagle3_draft, training_prompts
    from vllm_hs.models.tiny import build_tiny_model
    from vllm_hs_testing.engines import engine_metric

    model_dir = str(build_tiny_model("llama", "float32"))
    draft = str(build_eagle3_draft(model_dir))
    resolved = [0, 2, 4, "final_norm"]
    with engine(
        model_dir,
        "mp",
        dtype="float32",
        hidden_states_config={"layers": [0, 2, -1, "final_norm"]},
        speculative_config={
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": 3,
        },
        disable_log_stats=False,
        **CUDA_ENGINE,
    ) as llm:
        config = llm.llm_engine.vllm_config
        assert config.use_v2_model_runner == (runner == "v2")
        assert config.compilation_config.cudagraph_mode != 0
        cases = [
            (
                prompt,
                greedy(40, hidden_states={} if i % 3 else None),
                Expect(resolved) if i % 3 else None,
            )
            for i, prompt in enumerate(training_prompts(8))
        ]
        run_cases(
            llm, cases, model_dir, "float32", f"[cuda {runner} eagle3]", torch.bfloat16
        )
        drafts = engine_metric(llm, "vllm:spec_decode_num_draft_tokens")
        accepted = engine_metric(llm, "vllm:spec_decode_num_accepted_tokens")
        assert 0 < accepted < drafts, (accepted, drafts)
