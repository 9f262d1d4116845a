"""Does tritonserver unload a model after its clients cancel their gRPC streams right after the final response?

    python benchmarks/unload_after_cancel.py [--trials 8]

For our model (tiny checkpoint, CPU) and for a minimal decoupled Python model (three responses from a thread,
the last one FINAL), with clients that cancel each stream once the final response is in and clients that read
each stream to its end. Per trial: start tritonserver, run 16 streams at once, send it SIGTERM, and see whether
it unloaded the model or waited out its 30 s exit timeout ("Exit timeout expired"; the model's stub process is
then left behind, and is killed here). Prints the count of clean unloads per case.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_bench import query_images  # noqa: E402
from benchmarks.triton_bench import wait_ready  # noqa: E402
from client import build_inputs, response_body  # noqa: E402
from kestrel_backend.triton.local_server import REPOSITORY, server_command  # noqa: E402

ECHO_MODEL = '''
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.reply, args=(request.get_response_sender(),), daemon=True).start()

    def reply(self, sender):
        for i in range(3):
            time.sleep(0.01)
            out = pb_utils.Tensor("OUT", np.array([b"x"], dtype=np.object_))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == 2 else 0)
'''
ECHO_CONFIG = '''name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
'''


def echo_repository(folder: Path) -> Path:
    (folder / "echo" / "1").mkdir(parents=True)
    (folder / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    (folder / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    return folder


def moondream_request(image: bytes) -> tuple[dict, callable]:
    """(the stream's request, whether a result is the final one)."""
    inputs = build_inputs("query", image=image, question="Describe.", stream=True,
                          settings={"temperature": 0, "max_tokens": 8})
    is_final = lambda result: response_body(result).get("completed", False)
    return {"model_name": "moondream", "inputs": inputs}, is_final


def echo_request(_image: bytes) -> tuple[dict, callable]:
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("IN", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a"], dtype=np.object_))
    seen = []

    def is_final(_result) -> bool:
        seen.append(1)
        return len(seen) == 3
    return {"model_name": "echo", "inputs": [text]}, is_final


async def streams(url: str, make_request, images: list[bytes], n: int, cancel: bool) -> None:
    import tritonclient.grpc.aio as grpcaio

    async def one(image: bytes) -> None:
        request, is_final = make_request(image)

        async def requests():
            yield {**request, "request_id": uuid.uuid4().hex}
        responses = client.stream_infer(requests())
        async for result, error in responses:
            if error is not None:
                raise RuntimeError(error)
            if is_final(result) and cancel:
                responses.cancel()
                return

    client = grpcaio.InferenceServerClient(url)
    try:
        await asyncio.gather(*(one(images[i % len(images)]) for i in range(n)))
    finally:
        await client.close()


def trial(repository: Path, model: str, make_request, images, cancel: bool, port: int) -> bool:
    """One server's life -> True if it unloaded the model when told to stop."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "tritonserver.log"
        cmd, server_env = server_command(port - 1, port, port + 1, repository=repository, work=Path(tmp) / "runtime")
        with open(log_path, "w") as log:
            server = subprocess.Popen(cmd, env=server_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"localhost:{port}", server, 120, model)
            asyncio.run(streams(f"localhost:{port}", make_request, images, 16, cancel))
            server.terminate()
            server.wait(90)
            return "Exit timeout expired" not in log_path.read_text()
        except subprocess.TimeoutExpired:  # not even its exit timeout ended it
            return False
        finally:  # a server still running (never ready, or stuck), a stub left behind (both name this folder)
            server.kill()
            subprocess.run(["pkill", "-9", "-f", tmp])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--grpc-port", type=int, default=8301)
    args = p.parse_args()
    images = query_images(2)
    with tempfile.TemporaryDirectory() as tmp:
        cases = {"moondream": (REPOSITORY, moondream_request),  # (no weights configured: the tiny checkpoint)
                 "echo": (echo_repository(Path(tmp)), echo_request)}
        for model, (repository, make_request) in cases.items():
            for cancel in (True, False):
                clean = sum(trial(repository, model, make_request, images, cancel, args.grpc_port + 10 * i)
                            for i in range(args.trials))
                how = "cancel at the final response" if cancel else "read to the end"
                print(f"{model}, clients {how}: {clean}/{args.trials} clean unloads", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
