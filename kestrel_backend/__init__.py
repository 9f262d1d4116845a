"""Kestrel-Triton: Moondream 2 served by an in-process continuous-batching engine."""
