"""Triton Python-backend entry point: thin; the engine and the wire protocol live in kestrel_backend."""

import json

import triton_python_backend_utils as pb_utils

from kestrel_backend.triton.adapter import TritonAdapter


class TritonPythonModel:
    def initialize(self, args):
        # Engine settings: KESTREL_* env vars, else this model's config.pbtxt parameters.
        self.adapter = TritonAdapter(json.loads(args["model_config"]), pb_utils)

    def execute(self, requests):
        # Decoupled: responses go out through each request's response sender, from the engine loop.
        self.adapter.execute(requests)
        return None

    def finalize(self):
        self.adapter.shutdown()
