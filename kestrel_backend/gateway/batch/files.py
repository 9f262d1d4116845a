"""The batch data folder: the parts of uploads in progress, and each job's input file until its lines have run.

Every gateway that shares a job store must see the same folder (the Helm chart mounts one volume in every gateway).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

from .limits import BatchLimits
from ..errors import ApiError


# How old the folder's walked size may be: an upload of 10,000 parts would otherwise walk every part so far (and
# its etag) at each part, and the metrics at each heartbeat
USAGE_TTL_S = 1.0


class DataFolder:
    def __init__(self, root: str | Path, limits: BatchLimits):
        self.root, self.limits = Path(root), limits
        (self.root / "uploads").mkdir(parents=True, exist_ok=True)
        (self.root / "inputs").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._walked, self._walked_at, self._admitted = 0, float("-inf"), 0  # (admitted: since the last walk)

    def part_path(self, file_id: str, number: int) -> Path:
        return self.root / "uploads" / file_id / f"{number:05d}.part"

    def input_path(self, job_id: str) -> Path:
        return self.root / "inputs" / f"{job_id}.jsonl"

    def check_room(self, incoming: int) -> None:
        """Refuses what would take the folder over its bound (--batch-max-disk-gb); what it lets in counts until the
        next walk of the folder sees it written."""
        with self._lock:
            used = self._bytes_used()
            if used + incoming > self.limits.max_disk_bytes:
                raise ApiError(507, f"the batch data folder holds {used} bytes; {incoming} more would pass its "
                                    f"{self.limits.max_disk_bytes} byte bound; retry when running jobs have finished",
                               code="limit_exceeded")
            self._admitted += incoming

    def bytes_used(self) -> int:
        """The folder's bytes as last walked (at most USAGE_TTL_S ago), and those admitted since."""
        with self._lock:
            return self._bytes_used()

    def _bytes_used(self) -> int:
        if time.monotonic() - self._walked_at > USAGE_TTL_S:
            self._walked = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
            self._walked_at, self._admitted = time.monotonic(), 0
        return self._walked + self._admitted

    def open_part(self, file_id: str, number: int):
        """(a file open for writing the part, a running md5): the caller writes, then commit_part."""
        path = self.part_path(file_id, number)
        path.parent.mkdir(exist_ok=True)
        return open(path.with_suffix(".partial"), "wb"), hashlib.md5(usedforsecurity=False)

    def commit_part(self, file_id: str, number: int, etag: str) -> None:
        """The part written whole, and the etag it was answered with beside it (completion compares them)."""
        path = self.part_path(file_id, number)
        os.replace(path.with_suffix(".partial"), path)
        path.with_suffix(".etag").write_text(etag)

    def discard_part(self, file_id: str, number: int) -> None:
        self.part_path(file_id, number).with_suffix(".partial").unlink(missing_ok=True)

    def part_etag(self, file_id: str, number: int) -> str | None:
        """The etag the part was answered with; None where there is no such part."""
        path = self.part_path(file_id, number)
        return path.with_suffix(".etag").read_text() if path.exists() and path.with_suffix(".etag").exists() else None

    def assemble(self, file_id: str, numbers: list[int], job_id: str) -> int:
        """The parts, in order, into the job's input file; returns its size. The parts are removed."""
        target = self.input_path(job_id)
        with open(target.with_suffix(".partial"), "wb") as out:
            for number in numbers:
                with open(self.part_path(file_id, number), "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        os.replace(target.with_suffix(".partial"), target)
        self.remove_upload(file_id)
        return target.stat().st_size

    def remove_upload(self, file_id: str) -> None:
        shutil.rmtree(self.root / "uploads" / file_id, ignore_errors=True)

    def read(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def orphan_inputs(self, in_use: set[str]) -> list[Path]:
        """Input files no chunking or processing job reads (their jobs finished, failed or expired)."""
        return [p for p in (self.root / "inputs").glob("*.jsonl") if str(p) not in in_use]
