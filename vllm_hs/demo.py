"""`vllm-hs demo`: extract hidden states from the embedded tiny model and check
them against HF transformers.

Builds (once, cached) a seeded tiny Llama with a tokenizer, starts the patched
vLLM engine with a hidden-state layer set, generates a few completions with
prompt and output states, recomputes every row with HF on the same weights, and
prints a summary. Exit status 0 only when every row matches.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from vllm_hs.input_checks import new_or_writable_dir, positive, require
from vllm_hs.patched_vllm import import_patched_vllm

DEMO_PROMPTS = (
    "The quick brown fox jumps over the lazy dog because",
    "Hidden states are the activations between decoder layers, and",
    "A draft model learns from the target model by",
)
DEMO_LAYERS: list[int | str] = [0, 2, -1, "final_norm"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="extract hidden states from the embedded tiny model and verify them",
        description=__doc__,
        epilog="What layer ids 0, 2, -1 and final_norm and each row mean: "
        "docs/conventions.md of the vllm-hs repository.",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="tokens to generate per prompt (default: %(default)s)",
    )
    parser.add_argument(
        "--inproc",
        action="store_true",
        help="run the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        " instead of vLLM's default multiprocess engine",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="use vLLM's default compiled (inductor) model instead of eager mode "
        "(about a minute more on the first run, then cached)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="also write each request's states to DIR/demo_{i}.safetensors",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    require("--max-tokens", args.max_tokens, positive)
    require("--output", args.output, new_or_writable_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vllm = import_patched_vllm()
    LLM, SamplingParams = vllm.LLM, vllm.SamplingParams

    from vllm_hs.models.tiny import build_tiny_model

    started = time.perf_counter()
    model_dir = str(build_tiny_model("llama", "float32"))
    print(f"model: {model_dir}")
    llm = LLM(
        model_dir,
        hidden_states_config={"layers": DEMO_LAYERS},
        # vLLM on CPU runs fp32 checkpoints in bf16 unless told otherwise.
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        max_model_len=512,
        enforce_eager=not args.compile,
    )
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            hidden_states={"prompt": True, "output": True},
        )
        t0 = time.perf_counter()
        outputs = llm.generate(list(DEMO_PROMPTS), params, use_tqdm=False)
        generate_s = time.perf_counter() - t0
        layers = list(llm.llm_engine.vllm_config.aux_output_config.hidden_states.layers)
    finally:
        llm.llm_engine.engine_core.shutdown()
    rows = [
        _summarize(i, out, model_dir, layers, args.output)
        for i, out in enumerate(outputs)
    ]
    _print_table(rows, layers, generate_s, time.perf_counter() - started)
    failed = [r for r in rows if not r["ok"]]
    if failed:
        print(f"FAILED: {len(failed)} request(s) differ from HF transformers")
        return 1
    print(
        "OK: every row matches HF transformers on the same weights "
        "(the model is random, so its text is noise)"
    )
    return 0


def _summarize(
    index: int, out: Any, model_dir: str, layers: list[Any], output: Path | None
) -> dict[str, Any]:
    import torch

    from vllm_hs.hf_reference import assert_states_close, hf_sequence_states

    completion = out.outputs[0]
    prompt_states = out.prompt_hidden_states
    output_states = completion.hidden_states
    ref_prompt, ref_output = hf_sequence_states(
        model_dir, out.prompt_token_ids, completion.token_ids, layers
    )
    ok = True
    error = ""
    try:
        assert_states_close(
            prompt_states, ref_prompt, dtype=prompt_states.dtype, what="prompt"
        )
        assert_states_close(
            output_states, ref_output, dtype=output_states.dtype, what="output"
        )
    except AssertionError as e:
        ok, error = False, str(e).splitlines()[0]
    max_diff = max(
        (prompt_states.float() - ref_prompt.float()).abs().max().item(),
        (output_states.float() - ref_output.float()).abs().max().item()
        if output_states.numel()
        else 0.0,
    )
    if output is not None:
        from safetensors.torch import save_file

        output.mkdir(parents=True, exist_ok=True)
        save_file(
            {
                "hidden_states": torch.cat([prompt_states, output_states]).contiguous(),
                "token_ids": torch.tensor(
                    list(out.prompt_token_ids) + list(completion.token_ids)[:-1]
                ),
            },
            str(output / f"demo_{index}.safetensors"),
        )
    return {
        "prompt": out.prompt,
        "text": completion.text,
        "prompt_shape": tuple(prompt_states.shape),
        "output_shape": tuple(output_states.shape),
        "dtype": str(prompt_states.dtype).removeprefix("torch."),
        "bytes": prompt_states.nbytes + output_states.nbytes,
        "max_diff": max_diff,
        "ok": ok,
        "error": error,
    }


def _print_table(
    rows: list[dict[str, Any]], layers: list[Any], generate_s: float, total_s: float
) -> None:
    print(
        f"layers: {layers} (ids: k = residual entering layer k; "
        f"L = last layer before the final norm; 'final_norm' = LM-head input)"
    )
    header = f"{'#':>2}  {'prompt [P,K,H]':>16}  {'output [G-1,K,H]':>17}  "
    header += f"{'dtype':>8}  {'bytes':>8}  {'max|vllm-hf|':>12}  ok"
    print(header)
    for i, r in enumerate(rows):
        print(
            f"{i:>2}  {str(list(r['prompt_shape'])):>16}  "
            f"{str(list(r['output_shape'])):>17}  {r['dtype']:>8}  "
            f"{r['bytes']:>8}  {r['max_diff']:>12.2e}  {'yes' if r['ok'] else 'NO'}"
        )
        print(f"    {r['prompt']!r} -> {r['text']!r}")
        if r["error"]:
            print(f"    {r['error']}")
    total = sum(r["bytes"] for r in rows)
    print(
        f"{len(rows)} requests, {total} bytes of hidden states; generate "
        f"{generate_s:.2f} s, total {total_s:.1f} s"
    )
