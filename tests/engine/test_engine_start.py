"""Engine start: the compiled engine and its cache key, engines without the
channel, and models that cannot capture intermediate layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_hs.hf_reference import hf_greedy
from vllm_hs.models.tiny import seeded_prompt
from vllm_hs_testing.engines import engine
from vllm_hs_testing.hf_checks import Expect, check_output
from vllm_hs_testing.requests import greedy, tokens_prompt


def test_compiled_engines_in_turn_never_reuse_a_stale_graph(llama_fp32):
    """The default compiled (inductor) engine, started in turn with no config,
    one layer set and another: the layer set is part of the compile-cache key,
    so each engine returns its own rows."""
    prompt = seeded_prompt(300, 37)
    with engine(llama_fp32, "inproc", dtype="float32") as llm:
        (out,) = llm.generate([tokens_prompt(prompt)], greedy(6), use_tqdm=False)
        assert list(out.outputs[0].token_ids) == hf_greedy(llama_fp32, prompt, 6)
        check_output(out, llama_fp32, None, torch.float32, "no config")
        with pytest.raises(ValueError, match="started without hidden_states_config"):
            llm.generate([tokens_prompt(prompt)], greedy(2, hidden_states={}))
        (out,) = llm.generate([tokens_prompt(prompt)], greedy(2), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2
    # The second engine runs without prefix caching: no hit would read stored
    # rows, so none are stored (store_bytes resolves to 0).
    for layers, prefix_caching in (([1, 3], True), ([0, -1, "final_norm"], False)):
        with engine(
            llama_fp32,
            "inproc",
            dtype="float32",
            hidden_states_config={"layers": layers},
            enable_prefix_caching=prefix_caching,
        ) as llm:
            config = llm.llm_engine.vllm_config.compilation_config
            assert config.mode != 0, "expected the default compiled engine"
            hs_config = llm.llm_engine.vllm_config.aux_output_config.hidden_states
            assert hs_config.store_bytes == (1 << 30 if prefix_caching else 0)
            (out,) = llm.generate(
                [tokens_prompt(prompt)], greedy(6, hidden_states={}), use_tqdm=False
            )
            resolved = [4 if k == -1 else k for k in layers]
            check_output(
                out, llama_fp32, Expect(resolved), torch.float32, f"compiled {layers}"
            )


def test_default_config_is_eagle3_layers_plus_last(llama_fp32):
    """`{}` selects the Eagle-3 set (2, L//2, L-3) plus L: for L=4, (2, 2, 1)
    deduplicated to [2, 1], then 4; and the default per-request cap."""
    from vllm import SamplingParams

    with engine(
        llama_fp32,
        "inproc",
        dtype="float32",
        hidden_states_config={},
        enforce_eager=True,
    ) as llm:
        hs_config = llm.llm_engine.vllm_config.aux_output_config.hidden_states
        assert hs_config.layers == [2, 1, 4]
        resolved = hs_config.layers
        # A per-request cap by default (2 GiB): 3000 samples of 499 rows of
        # 3 x 128 fp32 values (1536 bytes) reach 2.3 GB and are refused before
        # they enter the engine.
        assert hs_config.max_bytes_per_request == 2 << 30
        with pytest.raises(ValueError, match="max_bytes_per_request=2147483648"):
            llm.generate(
                [tokens_prompt(seeded_prompt(303, 12))],
                SamplingParams(n=3000, max_tokens=500, hidden_states={}),
            )
        prompt = seeded_prompt(301, 11)
        (out,) = llm.generate(
            [tokens_prompt(prompt)], greedy(4, hidden_states={}), use_tqdm=False
        )
        check_output(out, llama_fp32, Expect(resolved), torch.float32, "default")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"layers": [7]}, "out of range"),
        ({"layers": [1, -1, 4]}, "duplicates"),
        ({"layers": ["last"]}, "Invalid hidden-state layer id"),
        ({"layers": [1], "max_bytes_per_request": 0}, "greater than 0"),
        ({"layers": [1], "bogus": 1}, "bogus"),
    ],
)
def test_bad_engine_config_fails_at_start(llama_fp32, config, match):
    from vllm import LLM

    with pytest.raises(Exception, match=match):
        LLM(llama_fp32, hidden_states_config=config, enforce_eager=True)


def test_kv_sharing_fast_prefill_is_refused_at_start(llama_fp32):
    """Fast prefill skips the upper layers of most prompt rows: no states."""
    from vllm import LLM

    with pytest.raises(ValueError, match="kv-sharing-fast-prefill"):
        LLM(
            llama_fp32,
            hidden_states_config={"layers": [1]},
            kv_sharing_fast_prefill=True,
            enforce_eager=True,
        )


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny GPT-2: vLLM's GPT2LMHeadModel has no aux-hidden-state support."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=256
    )
    path = tmp_path_factory.mktemp("gpt2")
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def _tiny_hf_model(tmp_path_factory, config_class: str, **config: object) -> Path:
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(config_class)
    cfg = getattr(transformers, config_class)(vocab_size=512, **config)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_model_without_layer_capture_fails_at_start(tmp_path_factory):
    """OPT has neither SupportsEagle3 nor a verified generic capture."""
    from vllm import LLM

    opt_dir = _tiny_hf_model(
        tmp_path_factory,
        "OPTConfig",
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=128,
        max_position_embeddings=256,
    )
    with pytest.raises(ValueError, match="OPTForCausalLM") as info:
        LLM(
            str(opt_dir),
            skip_tokenizer_init=True,
            hidden_states_config={"layers": [1]},
            enforce_eager=True,
        )
    assert "SupportsEagle3" in str(info.value)
    assert "final_norm" in str(info.value)


def test_layer_zero_on_the_transformers_backend_fails_at_start(tmp_path_factory):
    """vLLM runs Phi-2 on its Transformers modeling backend, which records the
    output of layer k-1 as id k: id 0 would crash the engine; it is refused."""
    from vllm import LLM

    phi_dir = _tiny_hf_model(
        tmp_path_factory,
        "PhiConfig",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    with pytest.raises(ValueError, match="Transformers modeling backend"):
        LLM(
            str(phi_dir),
            skip_tokenizer_init=True,
            hidden_states_config={"layers": [0, 1]},
            enforce_eager=True,
        )


def test_final_norm_works_on_any_model(gpt2_dir):
    """The post-norm state needs no aux support: GPT-2 serves it, equal to HF's
    last hidden state (after ln_f)."""
    from transformers import GPT2LMHeadModel

    from vllm_hs.hf_reference import assert_states_close

    with engine(
        str(gpt2_dir),
        "inproc",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        hidden_states_config={"layers": ["final_norm"]},
        enforce_eager=True,
    ) as llm:
        prompt = seeded_prompt(302, 20, vocab=512)
        (out,) = llm.generate(
            [tokens_prompt(prompt)],
            greedy(5, hidden_states={}, detokenize=False),
            use_tqdm=False,
        )
    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir, attn_implementation="eager").eval()
    tokens = prompt + list(out.outputs[0].token_ids)[:-1]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    rows = torch.cat([out.prompt_hidden_states, out.outputs[0].hidden_states])
    assert_states_close(
        rows, ref[:, None, :], dtype=torch.float32, what="gpt2 final_norm"
    )
