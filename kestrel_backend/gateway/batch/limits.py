"""The Batch API's bounds: the cloud's limits by default (docs.moondream.ai/batch: 2 GB a file, 100 MB a part,
100,000 lines, 10 MB a line, results kept 7 days), and this deployment's own (disk, concurrency, leases)."""

from __future__ import annotations

from dataclasses import dataclass

MB = 2**20


@dataclass(frozen=True)
class BatchLimits:
    max_file_bytes: int = 2 * 1024 * MB
    max_part_bytes: int = 100 * MB
    max_lines: int = 100_000
    max_line_bytes: int = 10 * MB
    retention_s: float = 7 * 24 * 3600.0  # a finished job's results are kept this long
    upload_ttl_s: float = 24 * 3600.0  # an upload never completed is removed after this
    max_disk_bytes: int = 100 * 1024 * MB  # the data folder's bound: uploads past it are refused (507)
    part_timeout_s: float = 600.0  # a part's whole body must arrive within this
    lines_per_replica: int = 64  # batch lines in flight at once, for each ready replica
    lease_s: float = 30.0  # a claimed line returns to the pool this long after its gateway stopped renewing it
    heartbeat_s: float = 5.0  # how often a gateway renews its leases
