"""vllm-hs: a hidden-state output channel for vLLM, as a versioned patch series."""

__version__ = "0.1.0"
