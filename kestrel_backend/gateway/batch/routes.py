"""The Batch API's routes, in the cloud's shapes (docs.moondream.ai/batch):

    POST   /v1/batch?action=mpu-create                                   -> {fileId, uploadId, key}
    PUT    /v1/batch/{fileId}?action=mpu-uploadpart&uploadId=&partNumber= -> {etag, partNumber}   (a part: <= 100 MB)
    POST   /v1/batch/{fileId}?action=mpu-complete&uploadId=  {parts, model} -> {id, status: chunking, size}
    DELETE /v1/batch/{fileId}?action=mpu-abort&uploadId=
    GET    /v1/batch?limit=&cursor=                                       -> {batches, next_cursor, has_more}
    GET    /v1/batch/{id}                                                 -> status, progress, usage, outputs
    GET    /v1/batch/{id}/results                                        -> JSON Lines, one a line of input, in order
    DELETE /v1/batch/{id}                                                 -> aborted (ours: the cloud has no abort)

A job belongs to the API key that made it: another key sees no trace of it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import datetime, timezone

from pathlib import Path

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import ApiError
from ..payloads import Limits, json_body, with_model
from .files import DataFolder
from .limits import BatchLimits
from .lines import error_line
from .store import FINISHED, JobStore, new_id
from ..upstream import Upstream
from .worker import BatchMetrics, BatchWorker

LIST_LIMIT, LIST_MAX = 50, 100
COMPLETE_BODY = Limits(max_body_bytes=2**20)  # mpu-complete's JSON: the list of parts


@dataclass(frozen=True)
class BatchConfig:
    data_dir: str  # uploads and input files (every gateway sharing the job store must see the same folder)
    db_url: str | None = None  # a SQLAlchemy URL; None: SQLite in data_dir/batch.db
    limits: BatchLimits = BatchLimits()

    def service(self, upstream: Upstream, limits: Limits, served: list[str], timeout_s: float,
                registry: CollectorRegistry) -> "BatchService":
        folder = DataFolder(self.data_dir, self.limits)  # (made first: SQLite's file is in it by default)
        store = JobStore(self.db_url or f"sqlite:///{Path(self.data_dir).resolve() / 'batch.db'}")
        worker = BatchWorker(store, folder, upstream, limits, served, self.limits, timeout_s, BatchMetrics(registry))
        return BatchService(store, folder, worker, self.limits, served)


@dataclass
class BatchService:
    store: JobStore
    folder: DataFolder
    worker: BatchWorker
    limits: BatchLimits
    served: list[str]

    async def start(self) -> None:
        await self.worker.start()

    async def close(self) -> None:
        await self.worker.close()
        self.store.close()

    # routes

    async def root(self, request: Request) -> Response:
        if request.method == "GET":
            return await self._list(request)
        if _action(request) == "mpu-create":
            row = await asyncio.to_thread(self.store.create_upload, _owner(request))
            return JSONResponse({"fileId": row["file_id"], "uploadId": row["upload_id"],
                                 "key": f"requests/{row['file_id']}.jsonl"})
        raise ApiError(400, "POST /v1/batch takes ?action=mpu-create (then upload parts and complete the upload)")

    async def one(self, request: Request) -> Response:
        name, action = request.path_params["id"], _action(request)
        if request.method == "GET" and action is None:
            return JSONResponse(_status(await self._job(request, name), request))
        if request.method == "DELETE" and action is None:
            return await self._abort(request, name)
        handler = {("PUT", "mpu-uploadpart"): self._upload_part, ("POST", "mpu-complete"): self._complete,
                   ("DELETE", "mpu-abort"): self._abort_upload}.get((request.method, action))
        if handler is None:
            raise ApiError(400, f"{request.method} /v1/batch/{{id}} does not take action={action}; see the Batch API's "
                                "routes in README")
        return await handler(request, name, await self._upload(request, name))

    async def results(self, request: Request) -> Response:
        job = await self._job(request, request.path_params["id"])
        if job["status"] not in ("completed", "aborted"):
            raise ApiError(409, f"batch {job['id']} is {job['status']}; its results come once it has completed "
                                "(or was aborted)", code="not_ready")

        async def lines():
            rows = self.store.results(job["id"])
            while True:
                page = await asyncio.to_thread(_next_page, rows)
                if not page:
                    return
                yield "".join(_result_line(row) + "\n" for row in page)
        return StreamingResponse(lines(), media_type="application/jsonl",
                                 headers={"Content-Disposition": f'attachment; filename="{job["id"]}.jsonl"'})

    # uploads

    async def _upload(self, request: Request, file_id: str) -> dict:
        upload_id = request.query_params.get("uploadId") or ""
        row = await asyncio.to_thread(self.store.upload, file_id, upload_id, _owner(request))
        if row is None:
            raise ApiError(404, f"no upload {file_id[:40]} with that uploadId", code="not_found")
        return row

    async def _upload_part(self, request: Request, file_id: str, upload: dict) -> Response:
        number = request.query_params.get("partNumber", "")
        if not number.isdigit() or not 1 <= int(number) <= 10_000:
            raise ApiError(400, "partNumber must be an integer from 1 to 10000")
        number = int(number)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limits.max_part_bytes:
            raise ApiError(413, f"a part is at most {self.limits.max_part_bytes} bytes; split the file into more "
                                "parts", code="limit_exceeded")
        await asyncio.to_thread(self.folder.check_room, int(declared) if declared.isdigit() else 0)
        out, digest = self.folder.open_part(file_id, number)
        try:
            await asyncio.wait_for(self._receive(request, out, digest), self.limits.part_timeout_s)
            out.close()
            etag = f'"{digest.hexdigest()}"'
            self.folder.commit_part(file_id, number, etag)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the part did not arrive within {self.limits.part_timeout_s:g} s") from None
        finally:
            out.close()
            self.folder.discard_part(file_id, number)
        return JSONResponse({"etag": etag, "partNumber": number})

    async def _receive(self, request: Request, out, digest) -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limits.max_part_bytes:
                raise ApiError(413, f"a part is at most {self.limits.max_part_bytes} bytes; split the file into more "
                                    "parts", code="limit_exceeded")
            digest.update(chunk)
            await asyncio.to_thread(out.write, chunk)

    async def _complete(self, request: Request, file_id: str, upload: dict) -> Response:
        body = await json_body(request, COMPLETE_BODY)
        parts = body.get("parts")
        if not isinstance(parts, list) or not parts or not all(
                isinstance(p, dict) and isinstance(p.get("partNumber"), int) and isinstance(p.get("etag"), str)
                for p in parts):
            raise ApiError(400, "parts must be a non-empty list of {partNumber, etag}")
        numbers = [p["partNumber"] for p in parts]
        if numbers != sorted(set(numbers)):
            raise ApiError(400, "parts must be in ascending partNumber order, each once")
        size = 0
        for p in parts:
            if self.folder.part_etag(file_id, p["partNumber"]) != _quoted(p["etag"]):
                raise ApiError(400, f"part {p['partNumber']} was not uploaded, or its etag differs")
            size += self.folder.part_path(file_id, p["partNumber"]).stat().st_size
        if size > self.limits.max_file_bytes:
            raise ApiError(413, f"the file is {size} bytes, over the {self.limits.max_file_bytes} byte limit",
                           code="limit_exceeded")
        model = self._model(body.get("model"))
        job_id = new_id()
        path = str(self.folder.input_path(job_id))
        worker = self.worker
        await asyncio.to_thread(self.store.create_job, job_id, _owner(request), model, size, path, worker.holder,
                                self.limits.lease_s, file_id)
        await asyncio.to_thread(self.folder.assemble, file_id, numbers, job_id)
        worker.chunk(job_id, path)
        return JSONResponse({"id": job_id, "status": "chunking", "size": size})

    def _model(self, model) -> str:
        """A served model's name, or <name>/<adapter id> (a finetune: moondream3-preview/<finetune_id>@<step>)."""
        if model is None:
            return self.served[0]
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string", code="invalid_model")
        try:
            with_model({"model": model}, None, self.served)
        except ApiError as e:
            raise ApiError(400, e.message, code="invalid_model") from None
        return model

    async def _abort_upload(self, request: Request, file_id: str, upload: dict) -> Response:
        await asyncio.to_thread(self.store.delete_upload, file_id)
        self.folder.remove_upload(file_id)
        return JSONResponse({"fileId": file_id, "status": "aborted"})

    # jobs

    async def _job(self, request: Request, job_id: str) -> dict:
        job = await asyncio.to_thread(self.store.job, job_id, _owner(request))
        if job is None:
            raise ApiError(404, f"no batch {job_id[:40]} (or it expired)", code="not_found")
        return job

    async def _abort(self, request: Request, job_id: str) -> Response:
        await self._job(request, job_id)
        job = await asyncio.to_thread(self.store.abort, job_id, _owner(request), self.limits.retention_s)
        return JSONResponse(_status(job, request))

    async def _list(self, request: Request) -> Response:
        limit = request.query_params.get("limit", str(LIST_LIMIT))
        if not limit.isdigit() or not 1 <= int(limit) <= LIST_MAX:
            raise ApiError(400, f"limit must be an integer from 1 to {LIST_MAX}")
        cursor = request.query_params.get("cursor") or None
        rows, more = await asyncio.to_thread(self.store.list_jobs, _owner(request), int(limit), cursor)
        return JSONResponse({"batches": [_status(r, request) for r in rows],
                             "next_cursor": rows[-1]["id"] if more else None, "has_more": more})


def _action(request: Request) -> str | None:
    return request.query_params.get("action")


def _owner(request: Request) -> str:
    key = getattr(request.state, "key", None)
    return key.owner if key is not None else ""


def _quoted(etag: str) -> str:
    return etag if etag.startswith('"') else f'"{etag}"'


def _time(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(job: dict, request: Request) -> dict:
    out = {"id": job["id"], "status": job["status"], "model": job["model"], "size": job["size"],
           "progress": {"total": job["total"], "completed": job["completed"], "failed": job["failed"]},
           "usage": {"input_tokens": job["input_tokens"], "output_tokens": job["output_tokens"]},
           "created_at": _time(job["created_at"])}
    if job["status"] in FINISHED:
        out.update(completed_at=_time(job["completed_at"]), expires_at=_time(job["expires_at"]))
    if job["status"] in ("completed", "aborted"):  # the results come from the gateway itself (no storage URLs)
        out["outputs"] = [{"index": 0, "url": str(request.url_for("batch_results", id=job["id"]))}]
    if job["error"]:
        out["error"] = json.loads(job["error"])
    return out


def _next_page(rows) -> list:
    page = []
    for row in rows:
        page.append(row)
        if len(page) == 1000:
            break
    return page


def _result_line(row) -> str:
    index, line_id, result = row
    if result is not None:
        return result
    return json.dumps(error_line(index, json.loads(line_id) if line_id else None, "aborted",
                                 "the batch was aborted before this line ran"))
