"""python -m kestrel_backend.gateway --triton localhost:8001 [--triton host2:8001 | --triton-file F | --triton-dns
name:8001] --port 2020

Serves the Moondream API (/v1/query, /v1/caption, /v1/detect, /v1/point, /v1/segment) and OpenAI chat completions
(/v1/chat/completions) over the moondream model of one or several tritonservers (README: "The Moondream API").
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn

from .app import GatewayConfig, create_app
from .payloads import Limits
from .upstream import Upstream


def api_keys(env: dict, keys_file: str | None) -> frozenset[str]:
    """KESTREL_GATEWAY_API_KEYS (comma-separated) and a file of keys, one a line (# comments)."""
    keys = [k.strip() for k in env.get("KESTREL_GATEWAY_API_KEYS", "").split(",")]
    if keys_file:
        keys += [line.split("#")[0].strip() for line in Path(keys_file).read_text().splitlines()]
    return frozenset(k for k in keys if k)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m kestrel_backend.gateway")
    p.add_argument("--triton", action="append", default=[], help="a tritonserver's gRPC address (repeat for "
                   "several replicas)")
    p.add_argument("--triton-dns", help="name:port resolved every few seconds, each address a replica (a Kubernetes "
                   "headless Service)")
    p.add_argument("--triton-file", help="a file of tritonserver gRPC addresses, one a line, read every few seconds")
    p.add_argument("--triton-model", default="moondream", help="the model's name in Triton")
    p.add_argument("--model-name", action="append", help="a name the API's `model` field may take (repeat; default: "
                   "KESTREL_MODEL, else moondream)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=2020)
    p.add_argument("--api-keys-file", help="keys, one a line (also KESTREL_GATEWAY_API_KEYS, comma-separated); "
                   "without any key the gateway is open")
    p.add_argument("--max-body-mb", type=float, default=32)
    p.add_argument("--max-image-mb", type=float, default=20)
    p.add_argument("--fetch-image-urls", action="store_true", help="fetch http(s) image links (refused otherwise)")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--refresh-s", type=float, default=2.0, help="seconds between replica readiness checks")
    a = p.parse_args(argv)
    if not (a.triton or a.triton_dns or a.triton_file):
        p.error("name at least one tritonserver: --triton host:port, --triton-file or --triton-dns name:port")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    served = a.model_name or [os.environ.get("KESTREL_MODEL") or "moondream"]
    config = GatewayConfig(
        upstream=Upstream(a.triton_model, a.triton, a.triton_dns, a.triton_file, a.refresh_s), served=served,
        api_keys=api_keys(os.environ, a.api_keys_file),
        limits=Limits(int(a.max_body_mb * 2**20), int(a.max_image_mb * 2**20), a.fetch_image_urls),
        request_timeout_s=a.request_timeout)
    if not config.api_keys:
        logging.getLogger("kestrel.gateway").warning("no API key configured: the gateway is open to every caller "
                                                     "(keep it behind an ingress)")
    uvicorn.run(create_app(config), host=a.host, port=a.port, log_level="info", timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
