"""Hidden states of image prompts on the tiny Qwen2.5-VL: every row equals HF
transformers' forward over the same expanded prompt and the same pixels, image
positions included, under batching with text, prefix caching, chunked prefill
through an image, preemption and n > 1, in both engine modes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm import SamplingParams

from vllm_hs.models.tiny_vl import seeded_image
from vllm_hs_testing.engines import engine, engine_metric
from vllm_hs_testing.hf_checks import Expect, check_output
from vllm_hs_testing.requests import greedy
from vllm_hs_testing.vision import VL_BLOCK, VL_LAYERS

EXPECT = Expect(layers=VL_LAYERS)
#: 56x56: 4 image tokens; 84x56: 6; 112x112: 16.
SMALL, WIDE, LARGE = (56, 56), (84, 56), (112, 112)
PREAMBLE = (
    "You are a careful assistant who looks at the picture before answering "
    "the question about its colors and the number of cats in the house."
)


def _prompt(llm: Any, images: list[Any], text: str, preamble: str = "") -> dict:
    """A chat prompt with `images` after `preamble`, as vLLM takes it."""
    content: list[dict[str, str]] = []
    if preamble:
        content.append({"type": "text", "text": preamble})
    content += [{"type": "image"} for _ in images]
    content.append({"type": "text", "text": text})
    messages = [{"role": "user", "content": content}]
    prompt = llm.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    if not images:
        return {"prompt": prompt}
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


def _image_positions(llm: Any, out: Any) -> list[int]:
    image_token = llm.llm_engine.model_config.hf_config.image_token_id
    return [i for i, t in enumerate(out.prompt_token_ids) if t == image_token]


def _check(out: Any, model_dir: str, images: list[Any], what: str) -> None:
    check_output(out, model_dir, EXPECT, torch.float32, what, images=images)


def test_image_prompts_batched_with_text(vl_engine, vl_fp32):
    llm, mode = vl_engine
    cases = [
        ([seeded_image(1, *SMALL)], "What is in the picture?", ""),
        ([seeded_image(2, *SMALL), seeded_image(3, *WIDE)], "Compare them.", ""),
        ([], "Tell me a small story about a red cat.", ""),
        ([seeded_image(4, *LARGE)], "Describe it.", PREAMBLE),
    ]
    prompts = [_prompt(llm, images, text, pre) for images, text, pre in cases]
    outs = llm.generate(prompts, greedy(4, hidden_states=True), use_tqdm=False)
    for (images, _, _), out in zip(cases, outs, strict=True):
        tokens = sum({SMALL: 4, WIDE: 6, LARGE: 16}[i.size] for i in images)
        assert len(_image_positions(llm, out)) == tokens
        _check(out, vl_fp32, images, f"{mode} {len(images)} images")


def test_chunked_prefill_through_an_image(vl_engine, vl_fp32):
    llm, mode = vl_engine
    image = seeded_image(9, *LARGE)
    prompt = _prompt(llm, [image], "Describe it.", "You are a careful assistant.")
    out = llm.generate(prompt, greedy(3, hidden_states=True), use_tqdm=False)[0]
    # Alone in the engine, the prompt prefills in chunks of the 32-token
    # budget: one ends inside the image.
    rows = _image_positions(llm, out)
    assert rows[0] < 32 <= rows[-1], rows
    _check(out, vl_fp32, [image], f"{mode} chunked")


def test_same_image_hits_the_prefix_cache_another_does_not(vl_engine, vl_fp32):
    llm, mode = vl_engine
    llm.reset_prefix_cache()
    image, other = seeded_image(5, *LARGE), seeded_image(6, *LARGE)
    params = greedy(3, hidden_states=True)
    first = llm.generate(
        _prompt(llm, [image], "What?", PREAMBLE), params, use_tqdm=False
    )[0]
    again = llm.generate(
        _prompt(llm, [image], "What?", PREAMBLE), params, use_tqdm=False
    )[0]
    swapped = llm.generate(
        _prompt(llm, [other], "What?", PREAMBLE), params, use_tqdm=False
    )[0]
    start = _image_positions(llm, first)[0]
    assert first.prompt_token_ids == again.prompt_token_ids == swapped.prompt_token_ids
    # The same image: the hit covers image positions.
    assert again.num_cached_tokens > start, (again.num_cached_tokens, start)
    # Another image: the hit ends before the first block holding an image token.
    assert swapped.num_cached_tokens <= start - start % VL_BLOCK, (
        swapped.num_cached_tokens
    )
    _check(first, vl_fp32, [image], f"{mode} first")
    _check(again, vl_fp32, [image], f"{mode} cached")
    _check(swapped, vl_fp32, [other], f"{mode} other image")
    # Rows from the image on differ between the two images: not a stale hit.
    assert not torch.allclose(
        again.prompt_hidden_states[start:], swapped.prompt_hidden_states[start:]
    )


def test_n_children_share_the_image_prompt_rows(vl_engine, vl_fp32):
    llm, mode = vl_engine
    image = seeded_image(7, *WIDE)
    params = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=4, ignore_eos=True, hidden_states=True
    )
    out = llm.generate(_prompt(llm, [image], "Three answers."), params, use_tqdm=False)[
        0
    ]
    assert len(out.outputs) == 3
    _check(out, vl_fp32, [image], f"{mode} n=3")


def test_preempted_image_requests_return_every_row(vl_fp32):
    # 6 requests of 40 + 40 tokens (3 blocks each, 2 at admission) in a
    # 5-block KV cache: running requests outgrow it.
    with engine(
        vl_fp32,
        "inproc",
        dtype="float32",
        hidden_states_config={"layers": VL_LAYERS},
        max_model_len=128,
        block_size=VL_BLOCK,
        kv_cache_memory_bytes=160 * 2 * 2 * 32 * 4,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        limit_mm_per_prompt={"image": 1, "video": 0},
        enable_prefix_caching=False,
        enforce_eager=True,
        disable_log_stats=False,
    ) as llm:
        images = [seeded_image(20 + i, *LARGE) for i in range(6)]
        prompts = [
            _prompt(llm, [image], f"Picture {i}?") for i, image in enumerate(images)
        ]
        outs = llm.generate(prompts, greedy(40, hidden_states=True), use_tqdm=False)
        assert engine_metric(llm, "vllm:num_preemptions") > 0
        for i, (image, out) in enumerate(zip(images, outs, strict=True)):
            _check(out, vl_fp32, [image], f"preempted request {i}")


@pytest.mark.parametrize("prompt", [False, True])
def test_output_only_and_prompt_only(vl_engine, vl_fp32, prompt):
    llm, mode = vl_engine
    image = seeded_image(8, *SMALL)
    expect = Expect(layers=[2, "final_norm"], prompt=prompt, output=not prompt)
    out = llm.generate(
        _prompt(llm, [image], "Name one color."),
        greedy(
            3,
            hidden_states={
                "layers": [2, "final_norm"],
                "prompt": prompt,
                "output": not prompt,
            },
        ),
        use_tqdm=False,
    )[0]
    check_output(
        out, vl_fp32, expect, torch.float32, f"{mode} prompt={prompt}", images=[image]
    )
