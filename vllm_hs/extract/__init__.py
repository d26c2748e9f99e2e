"""`vllm-hs extract`: Eagle-3 training data (hidden states) from the patched vLLM
engine, in the offline format of speculators >= 0.5, SpecForge or ModelOpt.

Modules, in the order data flows:

- `cli` (the command line; vLLM's engine options: `engine_options`) builds one
  `settings.ExtractSettings`, checked once;
- `inputs`: conversations, chat template and loss masks, the plan of samples
  (`images`: image parts, and the engine's expanded prompts);
- `engine`: the model's facts (vLLM's `ModelConfig`), starting engines;
- `job`: one extraction from start to end (`job.extract`, one engine here),
  `on_ray` the same on Ray replicas;
- `loop` (the engine loop) and `writer` (the writer thread; `storage`: the
  stored dtype);
- the files: `records` (rows, skips, the summary, file names), `manifest`
  (vllm_hs_extract.json), `formats` (one module per trainer format: the sample
  files; `safetensors_file` writes speculators'), `dataset` (speculators'
  Arrow dataset and token_freq.pt), and `outdir` (the output directory:
  open, resume scan, finish, merge shards).

The user's guide is docs/extract.md.
"""
