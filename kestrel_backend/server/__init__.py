"""Triton server glue: wire protocol, the bridge TritonPythonModel delegates to, metrics, a local launcher."""
