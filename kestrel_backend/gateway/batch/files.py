"""The batch data folder: the parts of uploads in progress, and each job's input file until its lines have run.

Every gateway that shares a job store must see the same folder (the Helm chart mounts one volume in every gateway).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .limits import BatchLimits
from ..errors import ApiError


class DataFolder:
    def __init__(self, root: str | Path, limits: BatchLimits):
        self.root, self.limits = Path(root), limits
        (self.root / "uploads").mkdir(parents=True, exist_ok=True)
        (self.root / "inputs").mkdir(parents=True, exist_ok=True)

    def part_path(self, file_id: str, number: int) -> Path:
        return self.root / "uploads" / file_id / f"{number:05d}.part"

    def input_path(self, job_id: str) -> Path:
        return self.root / "inputs" / f"{job_id}.jsonl"

    def check_room(self, incoming: int) -> None:
        """Refuses what would take the folder over its bound (--batch-max-disk-gb)."""
        used = self.bytes_used()
        if used + incoming > self.limits.max_disk_bytes:
            raise ApiError(507, f"the batch data folder holds {used} bytes; {incoming} more would pass its "
                                f"{self.limits.max_disk_bytes} byte bound; retry when running jobs have finished",
                           code="limit_exceeded")

    def bytes_used(self) -> int:
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())

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
