"""Triton glue: wire protocol, the adapter TritonPythonModel delegates to, metrics, a local launcher."""
