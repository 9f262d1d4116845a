"""Kestrel-Triton: Moondream (2, 3 and 0.5B) served by an in-process continuous-batching engine."""
