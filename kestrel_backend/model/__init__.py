"""Moondream 2 in PyTorch: config, vision encoder, text decoder, region heads, weights, tokenizer."""
