"""Quantization types: block layouts, numpy reference dequantizers and kernel bindings (stub)."""
