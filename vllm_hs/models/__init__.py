"""Small seeded models built offline, for the default job, tests and benchmarks.

- `tiny`: the embedded default, a 4-layer Llama with its own tokenizer and chat
  template (`build_cached`), what `vllm-hs extract` and `demo` run without a model.
- `structured_target`: a tiny Llama trained on a synthetic language, so that a
  draft trained on its states is accepted (the acceptance suite).
- `eagle3_draft`: an EAGLE-3 draft for a tiny target, trained on its
  continuations (speculative-decoding tests and benchmarks).

Nothing here imports vLLM.
"""
