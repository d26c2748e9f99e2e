"""`vllm-hs extract`: Eagle-3 training data (hidden states) from the patched vLLM
engine, in the offline format of speculators >= 0.5.

Modules, in the order data flows: `inputs` (conversations, chat template and
loss masks, the plan of samples), `layers` (which hidden states), `runner` (the
engine loop and the writer thread: `runner.extract`), `format` (THE OUTPUT
FORMAT: every file of an output directory, the manifest, merging shards),
`outdir` (opening, resuming and finishing an output directory) and `cli` (the
command line).
"""
