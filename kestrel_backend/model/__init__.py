"""Moondream (2, 0.5B, 4-bit, 3) in PyTorch: config, vision encoder, text decoder (dense or mixture of experts),
region heads, weights, tokenizer."""
