"""A gateway's batch worker: it claims lines from the job store, sends each to the replica its image routes to (at most
lines_per_replica upstream for each ready replica), and records its result; it renews its leases, chunks the jobs it
takes, and sweeps what expired. Several gateways on one store share the work; a line a dead gateway held returns to
the pool when its lease runs out.

A few lines more than go upstream are claimed, read and parsed ahead (AHEAD_SHARE), so that a line whose answer comes
is replaced upstream at once: the store's transactions and the line's parsing are not between one line and the next."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from ...slots import Slots
from ..errors import ApiError
from ..payloads import Limits
from ..upstream import Upstream
from .chunking import BatchFileError, split_lines
from .files import DataFolder
from .limits import BatchLimits
from .lines import LineError, error_line, failed_call, line_call, ok_line
from .store import Claim, JobStore, new_id

log = logging.getLogger("kestrel.gateway.batch")
SWEEP_S = 30.0  # expired jobs, orphaned files, chunking a dead gateway left
IDLE_POLL_S = 1.0  # with room and no line to run, the store is asked again after this
FULL_PAUSE_S = 1.0  # every replica refused a line (full or stopping): no new claim for this long
AHEAD_SHARE = 4  # lines ready ahead: a quarter of those upstream (at least one)


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.jobs = Gauge("kestrel_gateway_batch_jobs", "Batch jobs in the store by state", ["state"],
                          registry=registry)
        self.lines = Counter("kestrel_gateway_batch_lines_total", "Batch lines this gateway ran, by outcome (ok or "
                             "the error's code)", ["outcome"], registry=registry)
        self.rate = Gauge("kestrel_gateway_batch_lines_per_second", "Batch lines this gateway finished a second, "
                          "over the last heartbeat", registry=registry)
        self.in_flight = Gauge("kestrel_gateway_batch_lines_in_flight", "Batch lines this gateway holds: upstream, "
                               "or read and ready to go", registry=registry)
        self.disk = Gauge("kestrel_gateway_batch_disk_bytes", "The batch data folder's and the job store's bytes",
                          ["where"], registry=registry)


class BatchWorker:
    def __init__(self, store: JobStore, folder: DataFolder, upstream: Upstream, limits: Limits, served: list[str],
                 batch: BatchLimits, timeout_s: float, metrics: BatchMetrics):
        self.store, self.folder, self.upstream, self.limits = store, folder, upstream, limits
        self.served, self.batch, self.timeout_s, self.metrics = served, batch, timeout_s, metrics
        self.holder = new_id()  # this gateway, as the store names the holder of a claim
        self.running: dict[asyncio.Task, Claim] = {}
        self.wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._chunking: set[asyncio.Task] = set()
        self._paused_until = 0.0
        self._finished_lines = 0
        # of the running ones, those sent and not yet answered: lines_per_replica for each ready replica
        self.upstream_lines = Slots(lambda: self.batch.lines_per_replica * self._ready_replicas(),
                                    recheck_s=IDLE_POLL_S)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(loop()) for loop in (self._claim_loop, self._heartbeat, self._sweep_loop)]

    async def close(self) -> None:
        """Stops claiming; lines in flight go back to the pool at once (another gateway, or this one started again,
        runs them)."""
        for task in [*self._tasks, *self._chunking, *self.running]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._chunking, *self.running, return_exceptions=True)

    def _ready_replicas(self) -> int:
        return sum(r.ready for r in self.upstream.replicas.values())

    @property
    def room(self) -> int:
        """Lines to claim: as many as may go upstream and a share more, ready ahead."""
        capacity = self.upstream_lines.limit()
        ahead = max(1, capacity // AHEAD_SHARE) if capacity else 0
        return capacity + ahead - len(self.running)

    async def _claim_loop(self) -> None:
        while True:
            claims = []
            if self.room > 0 and time.monotonic() >= self._paused_until:
                try:
                    claims = await asyncio.to_thread(self.store.claim, self.holder, self.room, self.batch.lease_s)
                except Exception:
                    log.exception("claiming batch lines failed")
            for claim in claims:
                task = asyncio.create_task(self._run(claim))
                self.running[task] = claim
                task.add_done_callback(self._ended)
            self.metrics.in_flight.set(len(self.running))
            if not claims or self.room <= 0:
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), IDLE_POLL_S)

    def _ended(self, task: asyncio.Task) -> None:
        self.running.pop(task, None)
        self.wake.set()

    async def _run(self, claim: Claim) -> None:
        line_id = None
        try:
            try:
                line = json.loads(await asyncio.to_thread(self.folder.read, claim.input_path, claim.offset,
                                                          claim.length))
                line_id = line.get("id")
                call = await line_call(line, claim.model, self.limits, self.served)
                async with self.upstream_lines.slot():
                    body = await self._answer(call)
                result = ok_line(claim.line_index, line_id, line["skill"], call.skill, body)
            except LineError as e:
                result = error_line(claim.line_index, line_id, e.code, e.message)
            except ApiError as e:
                error = failed_call(e)
                if error is None:  # every replica full or stopping: the line runs again later
                    self._paused_until = time.monotonic() + FULL_PAUSE_S
                    await asyncio.to_thread(self.store.release, claim, self.holder)
                    return
                result = error_line(claim.line_index, line_id, error.code, error.message)
            except OSError as e:
                result = error_line(claim.line_index, line_id, "processing_error", f"the job's input file could not "
                                    f"be read: {e.strerror}")
            except Exception:
                log.exception("batch line %s/%d failed", claim.job_id, claim.line_index)
                result = error_line(claim.line_index, line_id, "processing_error", "internal error")
            try:
                status = await asyncio.to_thread(self.store.finish, claim, self.holder, result,
                                                 self.batch.retention_s)
            except Exception:  # (no longer renewed, the line runs again once its lease lapses)
                log.exception("recording batch line %s/%d failed", claim.job_id, claim.line_index)
                return
        except asyncio.CancelledError:  # the gateway stops, or the job was aborted: back to the pool
            await asyncio.shield(asyncio.to_thread(self.store.release, claim, self.holder))
            raise
        self._finished_lines += 1
        self.metrics.lines.labels(result["status"] if result["status"] == "ok" else result["error"]["code"]).inc()
        if status is not None:
            log.info("batch %s %s", claim.job_id, status)
            Path(claim.input_path).unlink(missing_ok=True)  # (the cloud deletes inputs once processed, too)

    async def _answer(self, call) -> dict:
        last = None
        async with contextlib.aclosing(self.upstream.call(call.inputs, call.key, self.timeout_s)) as bodies:
            async for body in bodies:
                last = body
        if last is None:
            raise ApiError(502, "the server ended the request without an answer")
        return last

    def chunk(self, job_id: str, input_path: str) -> None:
        """Splits a job this gateway holds into its lines, in the background; then it is processing."""
        task = asyncio.create_task(self._chunk(job_id, input_path))
        self._chunking.add(task)
        task.add_done_callback(self._chunking.discard)

    async def _chunk(self, job_id: str, input_path: str) -> None:
        try:
            total = await asyncio.to_thread(split_lines, input_path, self.batch,
                                            lambda spans, first: self.store.add_lines(job_id, spans, first))
            if await asyncio.to_thread(self.store.start_processing, job_id, self.holder, total):
                log.info("batch %s: %d lines", job_id, total)
                self.wake.set()
            return
        except BatchFileError as e:
            code, message = e.code, e.message
        except OSError as e:
            code, message = "processing_failed", f"the input file could not be read: {e.strerror}"
        await asyncio.to_thread(self.store.fail_job, job_id, code, message, self.batch.retention_s)
        Path(input_path).unlink(missing_ok=True)
        log.info("batch %s failed: %s", job_id, message)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.batch.heartbeat_s)
            try:
                await asyncio.to_thread(self.store.renew, self.holder, self.batch.lease_s,
                                        list(self.running.values()))
                gone = await asyncio.to_thread(self.store.finished_since, {c.job_id for c in self.running.values()})
                for task, claim in list(self.running.items()):
                    if claim.job_id in gone:  # aborted (or expired): its lines in flight are not waited for
                        task.cancel()
            except Exception:
                log.exception("renewing batch leases failed")
            self.metrics.rate.set(self._finished_lines / self.batch.heartbeat_s)
            self._finished_lines = 0
            with contextlib.suppress(Exception):  # (the gauges wait for the next beat)
                await self._gauges()

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("sweeping the batch store failed")
            await asyncio.sleep(SWEEP_S)

    async def sweep(self) -> None:
        now = time.time()
        for job in await asyncio.to_thread(self.store.expired, now):
            await asyncio.to_thread(self.store.delete_job, job["id"])
            Path(job["input_path"]).unlink(missing_ok=True)
        for file_id in await asyncio.to_thread(self.store.stale_uploads, now - self.batch.upload_ttl_s):
            await asyncio.to_thread(self.store.delete_upload, file_id)
            self.folder.remove_upload(file_id)
        in_use = await asyncio.to_thread(self.store.inputs_in_use)
        for path in self.folder.orphan_inputs(in_use):
            path.unlink(missing_ok=True)
        job = await asyncio.to_thread(self.store.take_chunking, self.holder, self.batch.lease_s)
        if job is not None:  # its gateway died while chunking it
            self.chunk(job["id"], job["input_path"])

    async def _gauges(self) -> None:
        for state, count in (await asyncio.to_thread(self.store.jobs_by_state)).items():
            self.metrics.jobs.labels(state).set(count)
        self.metrics.disk.labels("data_folder").set(await asyncio.to_thread(self.folder.bytes_used))
        self.metrics.disk.labels("job_store").set(await asyncio.to_thread(self.store.size_bytes) or 0)
