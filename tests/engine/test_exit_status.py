"""Scripts that use the default multiprocess engine with hidden states and then
simply return from main() must exit 0: no native abort in interpreter teardown
("terminate called without an active exception", SIGABRT / status 134).

Each script runs in its own interpreter (an abort would come after the
script's own code has finished), VLLM_HS_EXIT_RUNS times (default 2, run as one
pair; about 100 s on 2 cores; set it higher to hunt an intermittent abort). The
scenario is the one the abort was seen with: prefix caching, chunked prefill
(48-token budget), a mixed batch of 11 requests with and without states, two
rounds, then an n=2 request, with HF transformers loaded in the same process.
Patch 0004 joins the sync engine client's output thread at shutdown, the daemon
thread that decodes tensors; its own regression test
(tests/v1/engine/test_sync_client_output_thread_shutdown.py, in the quick
subset of `test_upstream_tests`) checks the join deterministically.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RUNS = int(os.environ.get("VLLM_HS_EXIT_RUNS", "2"))

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from vllm import LLM, SamplingParams
    from vllm_hs.models.tiny import build_tiny_model
    from vllm_hs.hf_reference import load_hf_model

    def main():
        model = build_tiny_model("llama", "float32")
        llm = LLM(str(model), dtype="float32", kv_cache_memory_bytes=64 << 20,
                  enable_prefix_caching=True, max_num_batched_tokens=48,
                  block_size=32, max_model_len=512, seed=0,
                  hidden_states_config={"layers": [0, 2, -1, "final_norm"]})
        hf = load_hf_model(model)
        with torch.no_grad():
            hf(torch.tensor([[1, 2, 3, 4, 5]]))
        prompts = [{"prompt_token_ids": [(7 * i + j) % 100 + 8
                                         for j in range(20 + 9 * i)]}
                   for i in range(11)]
        for _ in range(2):  # second round reads the prefix cache
            params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                     **({"hidden_states": {}} if i % 2 == 0 else {}))
                      for i in range(11)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
            assert all(o.prompt_hidden_states is not None for o in outs[::2])
        out = llm.generate(prompts[3], SamplingParams(
            temperature=0.8, n=2, max_tokens=8, ignore_eos=True, hidden_states={}),
            use_tqdm=False)[0]
        assert len(out.outputs) == 2
        print("RESULTS OK", flush=True)
        # No shutdown, no os._exit: return and let the interpreter tear down.

    if __name__ == "__main__":
        main()
    """
)


def _run(script: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the default: multiprocess
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_multiprocess_script_exits_zero_every_time(tmp_path: Path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda _: _run(script, tmp_path), range(RUNS)))
    bad = [
        f"run {i}: exit {p.returncode}\n{p.stderr[-3000:]}"
        for i, p in enumerate(procs)
        if p.returncode != 0
        or "RESULTS OK" not in p.stdout
        or "terminate called" in p.stderr
    ]
    assert not bad, "\n\n".join(bad)
