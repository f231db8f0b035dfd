"""kvq_lab: a research ablation framework for KV-cache quantization."""

__version__ = "0.1.0"
