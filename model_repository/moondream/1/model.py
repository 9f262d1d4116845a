"""Triton Python-backend entry point: thin; the engine and the wire protocol live in kestrel_backend."""

import gc
import json

import triton_python_backend_utils as pb_utils

from kestrel_backend.triton.adapter import TritonAdapter


class TritonPythonModel:
    def initialize(self, args):
        # Engine settings: KESTREL_* env vars, else this model's config.pbtxt parameters. A KIND_GPU instance
        # (configs/multi_gpu.pbtxt: one per GPU) runs its own engine on its own GPU.
        instance = (args["model_instance_kind"], int(args["model_instance_device_id"]))
        self.adapter = TritonAdapter(json.loads(args["model_config"]), pb_utils, instance)

    def execute(self, requests):
        # Decoupled: responses go out through each request's response sender, from the engine loop.
        self.adapter.execute(requests)
        return None

    def finalize(self):
        self.adapter.shutdown()
        # the engine's weights and CUDA graphs go now, while the CUDA context lives, not at the stub's exit
        self.adapter = None
        gc.collect()
