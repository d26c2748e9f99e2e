"""Regression benchmarks of vllm-hs per vLLM release, run as `python -m
benchmarks` from the repository root (see benchmarks/__main__.py).

- protocol: what a suite declares (sides, settings, measure);
- runner: the one runner (versions, result files, report); rounds: the
  rotating order of sides; result: the result file; machine: machine facts;
- suites/: the suites; workload, peak_rss: the engine process a measurement
  runs in and its memory sampler;
- report, gate: the generated table and chart, and the release gate;
- model_shapes, unpatched_env: tools for gpu.sh and tox's bench env.
"""
