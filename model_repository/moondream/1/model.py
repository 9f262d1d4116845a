"""Triton Python-backend entry point: thin; the engine and the wire protocol live in kestrel_backend."""

import faulthandler
import gc
import json

import triton_python_backend_utils as pb_utils

from kestrel_backend.server.bridge import TritonBridge


class TritonPythonModel:
    def initialize(self, args):
        # Engine settings: KESTREL_* env vars, else this model's config.pbtxt parameters. A KIND_GPU instance
        # (configs/multi_gpu.pbtxt: one per GPU) runs its own engine on its own GPU.
        instance = (args["model_instance_kind"], int(args["model_instance_device_id"]))
        self.gpu_instance = instance[0] == "GPU"
        self.adapter = TritonBridge(json.loads(args["model_config"]), pb_utils, instance)

    def execute(self, requests):
        # Decoupled: responses go out through each request's response sender, from the engine loop.
        self.adapter.execute(requests)
        return None

    def finalize(self):
        # an unload that hangs (tritonserver then waits out its exit timeout) leaves every thread's stack in its log
        faulthandler.dump_traceback_later(15)
        try:
            self._release()
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _release(self):
        self.adapter.shutdown()
        if self.gpu_instance:
            # KIND_GPU instances (the several-GPU config): freeing the engine here corrupted the stub's heap after
            # finalize returned (glibc "unaligned tcache chunk"), so the model never unloaded and tritonserver hung
            # until its exit timeout; left to the stub's exit, the server exited 0 in 4.5 s (2 H200s, 2026-11-27)
            return
        # the engine's weights and CUDA graphs go now, while the CUDA context lives, not at the stub's exit
        self.adapter = None
        gc.collect()
