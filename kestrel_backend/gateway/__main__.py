"""python -m kestrel_backend.gateway --triton localhost:8001 [--triton host2:8001 | --triton-file F | --triton-dns
name:8001] --port 2020

Serves the Moondream API (/v1/query, /v1/caption, /v1/detect, /v1/point, /v1/segment), OpenAI chat completions
(/v1/chat/completions) and, with --batch-data, the Batch API (/v1/batch) over the moondream model of one or several
tritonservers (README: "The Moondream API", "Batch jobs").
"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from .app import GatewayConfig, create_app
from .batch.limits import BatchLimits
from .batch.routes import BatchConfig
from .http_protocol import HEADER_TIMEOUT_S, HeaderDeadlineProtocol
from .keys import ApiKeys
from .payloads import Limits
from .upstream import Upstream


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
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on: loopback by default; 0.0.0.0 for "
                   "every interface (a container behind a Service, an ingress)")
    p.add_argument("--port", type=int, default=2020)
    p.add_argument("--api-keys-file", help="keys, one a line, each with optional limits: concurrency=N rate=N/s (also "
                   "KESTREL_GATEWAY_API_KEYS, comma-separated); without any key the gateway is open")
    p.add_argument("--max-body-mb", type=float, default=32)
    p.add_argument("--max-image-mb", type=float, default=20)
    p.add_argument("--max-text-chars", type=int, default=4 * 2**20, help="longest text (a question, an object, a chat's "
                   "text in all) sent on to the model; longer is a 400 at once")
    p.add_argument("--fetch-image-urls", action="store_true", help="fetch http(s) image links (refused otherwise); "
                   "only public addresses unless --fetch-allow names others")
    p.add_argument("--fetch-allow", action="append", default=[], help="a network links may reach although not "
                   "public, e.g. 10.1.0.0/16 (repeat)")
    p.add_argument("--fetch-timeout", type=float, default=10.0, help="seconds for a link's whole fetch")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds for a request's whole body to arrive")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, help="seconds for a request's headers")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--refresh-s", type=float, default=2.0, help="seconds between replica readiness checks")
    b = p.add_argument_group("the Batch API (README: Batch jobs)")
    b.add_argument("--batch-data", default=os.environ.get("KESTREL_BATCH_DATA"), help="the folder for uploads and "
                   "input files (shared by every gateway of one job store); the Batch API is on when it is given")
    b.add_argument("--batch-db", default=os.environ.get("KESTREL_BATCH_DB"), help="the job store: a SQLAlchemy URL, "
                   "e.g. postgresql+psycopg://user:pass@host/db for several gateways (default: SQLite in the data "
                   "folder)")
    b.add_argument("--batch-lines-per-replica", type=int, default=BatchLimits.lines_per_replica,
                   help="batch lines in flight at once, for each ready replica")
    b.add_argument("--batch-retention-h", type=float, default=BatchLimits.retention_s / 3600, help="hours a "
                   "finished job's results are kept")
    b.add_argument("--batch-max-disk-gb", type=float, default=BatchLimits.max_disk_bytes / 2**30,
                   help="the data folder's bound: uploads past it are refused")
    b.add_argument("--batch-max-part-mb", type=float, default=BatchLimits.max_part_bytes / 2**20)
    b.add_argument("--batch-max-lines", type=int, default=BatchLimits.max_lines)
    b.add_argument("--batch-lease-s", type=float, default=BatchLimits.lease_s, help="seconds after which the lines "
                   "of a gateway that stopped renewing them (it died) go to another")
    a = p.parse_args(argv)
    if not (a.triton or a.triton_dns or a.triton_file):
        p.error("name at least one tritonserver: --triton host:port, --triton-file or --triton-dns name:port")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    served = a.model_name or [os.environ.get("KESTREL_MODEL") or "moondream"]
    config = GatewayConfig(
        upstream=Upstream(a.triton_model, a.triton, a.triton_dns, a.triton_file, a.refresh_s), served=served,
        api_keys=ApiKeys.load(os.environ, a.api_keys_file),
        limits=Limits(int(a.max_body_mb * 2**20), int(a.max_image_mb * 2**20), a.fetch_image_urls, a.fetch_timeout,
                      tuple(a.fetch_allow), a.body_timeout, a.max_text_chars),
        request_timeout_s=a.request_timeout,
        batch=None if not a.batch_data else BatchConfig(a.batch_data, a.batch_db, BatchLimits(
            max_part_bytes=int(a.batch_max_part_mb * 2**20), max_lines=a.batch_max_lines,
            retention_s=a.batch_retention_h * 3600, max_disk_bytes=int(a.batch_max_disk_gb * 2**30),
            lines_per_replica=a.batch_lines_per_replica, lease_s=a.batch_lease_s,
            heartbeat_s=min(BatchLimits.heartbeat_s, a.batch_lease_s / 3))))
    if not config.api_keys:
        logging.getLogger("kestrel.gateway").warning("no API key configured: the gateway is open to every caller "
                                                     "(keep it behind an ingress)")
    protocol = type("Protocol", (HeaderDeadlineProtocol,), {"header_timeout_s": a.header_timeout})
    uvicorn.run(create_app(config), host=a.host, port=a.port, log_level="info", timeout_graceful_shutdown=30,
                http=protocol)


if __name__ == "__main__":
    main()
