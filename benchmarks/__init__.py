"""Regression benchmarks of vllm-hs per vLLM release (see benchmarks/__main__.py)."""
