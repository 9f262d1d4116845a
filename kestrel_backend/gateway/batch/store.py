"""The job store: uploads, jobs and every line's state and result, in SQLite (one machine, the default) or PostgreSQL
(several gateways), through one SQLAlchemy data layer.

A line is claimed by one gateway at a time under a lease its gateway renews every few seconds; a gateway that dies
stops renewing, and its lines go to whichever gateway claims next. A result is written only by the line's current
claimant, in the same transaction as the job's counts, so no line is answered twice nor counted twice. PostgreSQL
claims with FOR UPDATE SKIP LOCKED (gateways never wait on each other's claims); SQLite takes its write lock at the
start of each transaction (BEGIN IMMEDIATE), which serializes claims across processes too.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Iterator

import sqlalchemy as sa

metadata = sa.MetaData()

uploads = sa.Table(
    "batch_uploads", metadata,
    sa.Column("file_id", sa.String(32), primary_key=True),
    sa.Column("upload_id", sa.String(64), nullable=False),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False))

jobs = sa.Table(
    "batch_jobs", metadata,
    sa.Column("id", sa.String(32), primary_key=True),  # time-ordered (list pages by it)
    sa.Column("owner", sa.String(64), nullable=False, index=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),  # JOB_STATES
    sa.Column("model", sa.String(300), nullable=False),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("input_path", sa.String(500), nullable=False),
    sa.Column("total", sa.Integer, nullable=False, default=0),
    sa.Column("completed", sa.Integer, nullable=False, default=0),  # lines answered
    sa.Column("failed", sa.Integer, nullable=False, default=0),  # lines with an error
    sa.Column("input_tokens", sa.BigInteger, nullable=False, default=0),
    sa.Column("output_tokens", sa.BigInteger, nullable=False, default=0),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("completed_at", sa.Float),
    sa.Column("expires_at", sa.Float),
    sa.Column("error", sa.Text),  # a failed job's {"code", "message"} (JSON)
    sa.Column("holder", sa.String(32)),  # the gateway chunking it, under a lease
    sa.Column("lease_until", sa.Float))

lines = sa.Table(
    "batch_lines", metadata,
    sa.Column("job_id", sa.String(32), sa.ForeignKey("batch_jobs.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("line_index", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("offset", sa.BigInteger, nullable=False),  # where the line is in the job's input file
    sa.Column("length", sa.Integer, nullable=False),
    sa.Column("line_id", sa.Text),  # the line's own `id` (JSON), returned with its result
    sa.Column("state", sa.String(8), nullable=False, default="pending"),  # pending | claimed | done
    sa.Column("holder", sa.String(32)),
    sa.Column("lease_until", sa.Float),
    sa.Column("result", sa.Text),  # the line's result line (JSON), once done
    sa.Index("batch_lines_state", "job_id", "state", "line_index"),
    sa.Index("batch_lines_lease", "state", "lease_until"))

JOB_STATES = ("chunking", "processing", "completed", "failed", "aborted")  # the cloud's four, and our abort
FINISHED = ("completed", "failed", "aborted")


def fair_shares(n: int, live: list, running: dict[str, int], claimable) -> dict[str, int]:
    """How many of n lines to claim from each live job (rows with id and owner, oldest first): one at a time to the API
    key with the fewest lines running (those given counted; the older job's key first on a tie) that has a line left,
    and within a key to its oldest job with one left. claimable(job id): that job's claimable lines (n at most), asked
    once a job and only while the key's older jobs have none left: a claim among hundreds of live jobs asks about a
    few of them, not every one."""
    jobs_of: dict[str, list] = {}
    for job in live:
        jobs_of.setdefault(job.owner, []).append(job)  # (keys in the order of their oldest job)
    left: dict[str, int] = {}

    def oldest_with_lines(owner: str):
        for job in jobs_of[owner]:
            if job.id not in left:
                left[job.id] = claimable(job.id)
            if left[job.id]:
                return job
        return None

    shares = {job.id: 0 for job in live}
    load = {owner: running.get(owner, 0) for owner in jobs_of}
    for _ in range(n):
        candidates = [(owner, job) for owner in jobs_of if (job := oldest_with_lines(owner)) is not None]
        if not candidates:
            break
        owner, job = min(candidates, key=lambda c: load[c[0]])  # (min keeps the first of equals)
        shares[job.id] += 1
        left[job.id] -= 1
        load[owner] += 1
    return shares


def new_id() -> str:
    """A ULID: 48 bits of milliseconds then 80 random bits, in Crockford's base 32, so ids sort by creation time."""
    value = (int(time.time() * 1000) << 80) | secrets.randbits(80)
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    return "".join(alphabet[(value >> shift) & 31] for shift in range(125, -1, -5))


@dataclass
class Claim:
    job_id: str
    line_index: int
    offset: int
    length: int
    model: str
    input_path: str


class JobStore:
    def __init__(self, url: str):
        """url: a SQLAlchemy database URL: sqlite:///path/to/batch.db, postgresql+psycopg://user@host/db."""
        self.url = sa.engine.make_url(url)
        self.sqlite = self.url.get_backend_name() == "sqlite"
        if self.sqlite:
            self.engine = sa.create_engine(self.url, connect_args={"check_same_thread": False, "timeout": 30})
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
            sa.event.listen(self.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
        else:
            self.engine = sa.create_engine(self.url, pool_size=8, max_overflow=8, pool_pre_ping=True)
        metadata.create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # uploads

    def create_upload(self, owner: str) -> dict:
        row = {"file_id": new_id(), "upload_id": secrets.token_hex(16), "owner": owner, "created_at": time.time()}
        with self.engine.begin() as db:
            db.execute(uploads.insert().values(row))
        return row

    def upload(self, file_id: str, upload_id: str, owner: str) -> dict | None:
        with self.engine.begin() as db:
            row = db.execute(uploads.select().where(uploads.c.file_id == file_id)).mappings().first()
        if row is None or row["owner"] != owner or not secrets.compare_digest(row["upload_id"], upload_id):
            return None
        return dict(row)

    def delete_upload(self, file_id: str) -> None:
        with self.engine.begin() as db:
            db.execute(uploads.delete().where(uploads.c.file_id == file_id))

    def stale_uploads(self, before: float) -> list[str]:
        with self.engine.begin() as db:
            return list(db.execute(sa.select(uploads.c.file_id).where(uploads.c.created_at < before)).scalars())

    # jobs

    def create_job(self, job_id: str, owner: str, model: str, size: int, input_path: str, holder: str,
                   lease_s: float, file_id: str | None = None) -> None:
        """A job in `chunking`, held by `holder` (which splits its file into lines next); its upload row goes."""
        now = time.time()
        with self.engine.begin() as db:
            db.execute(jobs.insert().values(id=job_id, owner=owner, status="chunking", model=model, size=size,
                                            input_path=input_path, total=0, completed=0, failed=0, input_tokens=0,
                                            output_tokens=0, created_at=now, holder=holder, lease_until=now + lease_s))
            if file_id is not None:
                db.execute(uploads.delete().where(uploads.c.file_id == file_id))

    def job(self, job_id: str, owner: str | None = None) -> dict | None:
        """A job's row; None when there is none (or it is another owner's)."""
        query = jobs.select().where(jobs.c.id == job_id)
        if owner is not None:
            query = query.where(jobs.c.owner == owner)
        with self.engine.begin() as db:
            row = db.execute(query).mappings().first()
        return dict(row) if row is not None else None

    def list_jobs(self, owner: str, limit: int, cursor: str | None) -> tuple[list[dict], bool]:
        """Newest first, `limit` of them after the cursor (the last id of the page before), and whether more follow."""
        query = jobs.select().where(jobs.c.owner == owner).order_by(jobs.c.id.desc()).limit(limit + 1)
        if cursor:
            query = query.where(jobs.c.id < cursor)
        with self.engine.begin() as db:
            rows = [dict(r) for r in db.execute(query).mappings()]
        return rows[:limit], len(rows) > limit

    def take_chunking(self, holder: str, lease_s: float) -> dict | None:
        """A job left in chunking by a gateway that stopped renewing its lease (it died): now held by `holder`."""
        now = time.time()
        with self.engine.begin() as db:
            row = db.execute(self._locked(jobs.select().where(jobs.c.status == "chunking", jobs.c.lease_until < now)
                                          .limit(1))).mappings().first()
            if row is None:
                return None
            db.execute(lines.delete().where(lines.c.job_id == row["id"]))  # (its lines are split again)
            db.execute(jobs.update().where(jobs.c.id == row["id"]).values(holder=holder, lease_until=now + lease_s))
        return dict(row)

    def add_lines(self, job_id: str, spans: list[tuple[int, int, str | None]], first_index: int) -> None:
        """Lines of a job being chunked: (offset, length, its `id` as JSON) each, indices from first_index."""
        with self.engine.begin() as db:
            db.execute(lines.insert(), [{"job_id": job_id, "line_index": first_index + i, "offset": offset,
                                         "length": length, "line_id": line_id, "state": "pending"}
                                        for i, (offset, length, line_id) in enumerate(spans)])

    def start_processing(self, job_id: str, holder: str, total: int) -> bool:
        with self.engine.begin() as db:
            return db.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.status == "chunking",
                                                  jobs.c.holder == holder)
                              .values(status="processing", total=total, holder=None, lease_until=None)).rowcount == 1

    def fail_job(self, job_id: str, code: str, message: str, retention_s: float) -> None:
        now = time.time()
        with self.engine.begin() as db:
            db.execute(lines.delete().where(lines.c.job_id == job_id))
            db.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.status.in_(("chunking", "processing")))
                       .values(status="failed", error=json.dumps({"code": code, "message": message}),
                               completed_at=now, expires_at=now + retention_s, holder=None, lease_until=None))

    def abort(self, job_id: str, owner: str, retention_s: float) -> dict | None:
        """Stops a job that is not finished (its lines not yet run are never run); the job's row after."""
        now = time.time()
        with self.engine.begin() as db:
            db.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.owner == owner,
                                           jobs.c.status.in_(("chunking", "processing")))
                       .values(status="aborted", completed_at=now, expires_at=now + retention_s, holder=None,
                               lease_until=None))
        return self.job(job_id, owner)

    def renew(self, holder: str, lease_s: float, held: list[Claim]) -> None:
        """Extends the leases of the lines `holder` still runs (held) and of the jobs it is chunking (its heartbeat). A
        line it claimed and no longer runs (its result could not be recorded) is not renewed: it runs again once its
        lease lapses."""
        until = time.time() + lease_s
        with self.engine.begin() as db:
            _update_lines(db, held, lines.c.holder == holder, lines.c.state == "claimed", lease_until=until)
            db.execute(jobs.update().where(jobs.c.holder == holder, jobs.c.status == "chunking")
                       .values(lease_until=until))

    def finished_since(self, job_ids: set[str]) -> set[str]:
        """Of these jobs, those that are no longer processing (aborted, failed, expired)."""
        if not job_ids:
            return set()
        with self.engine.begin() as db:
            live = set(db.execute(sa.select(jobs.c.id).where(jobs.c.id.in_(job_ids),
                                                             jobs.c.status == "processing")).scalars())
        return set(job_ids) - live

    # lines

    def claim(self, holder: str, n: int, lease_s: float) -> list[Claim]:
        """Up to n lines to run: pending ones, and claimed ones whose holder stopped renewing their lease. Shared fairly
        between the API keys with jobs processing (fair_shares: one key's large job does not hold back another's), each
        key's oldest job first."""
        now = time.time()
        claimable = sa.or_(lines.c.state == "pending", sa.and_(lines.c.state == "claimed", lines.c.lease_until < now))
        claimed: list[Claim] = []
        with self.engine.begin() as db:
            live = list(db.execute(sa.select(jobs.c.id, jobs.c.owner, jobs.c.model, jobs.c.input_path)
                                   .where(jobs.c.status == "processing").order_by(jobs.c.id)).all())
            if len({job.owner for job in live}) > 1:
                def waiting(job_id: str) -> int:  # (n at most: enough to share)
                    return db.execute(sa.select(sa.func.count()).select_from(sa.select(lines.c.line_index).where(
                        lines.c.job_id == job_id, claimable).limit(n).subquery())).scalar()
                shares = fair_shares(n, live, self._running_by_owner(db, now), waiting)
            else:
                shares = {job.id: n for job in live}  # (one key: its oldest job first, the next with what is left)
            for job in live:
                want = min(shares[job.id], n - len(claimed))
                if want <= 0:
                    continue
                rows = db.execute(self._locked(
                    sa.select(lines.c.line_index, lines.c.offset, lines.c.length)
                    .where(lines.c.job_id == job.id, claimable).order_by(lines.c.line_index).limit(want))).all()
                claimed += [Claim(job.id, r.line_index, r.offset, r.length, job.model, job.input_path) for r in rows]
            _update_lines(db, claimed, state="claimed", holder=holder, lease_until=now + lease_s)
        return claimed

    @staticmethod
    def _running_by_owner(db, now: float) -> dict[str, int]:
        """Lines claimed under a live lease (by any gateway), by the API key whose job they are."""
        return dict(db.execute(sa.select(jobs.c.owner, sa.func.count()).select_from(
            lines.join(jobs, lines.c.job_id == jobs.c.id)).where(
            lines.c.state == "claimed", lines.c.lease_until >= now, jobs.c.status == "processing").group_by(
            jobs.c.owner)).all())

    def release(self, claim: Claim, holder: str) -> None:
        """A line given back unrun (every replica was full, or the job was aborted): pending again."""
        with self.engine.begin() as db:
            db.execute(lines.update().where(lines.c.job_id == claim.job_id, lines.c.line_index == claim.line_index,
                                            lines.c.holder == holder, lines.c.state == "claimed")
                       .values(state="pending", holder=None, lease_until=None))

    def finish(self, claim: Claim, holder: str, result: dict, retention_s: float) -> str | None:
        """Records a line's result line (its "status" ok or error, its "usage") if `holder` still has the line, and
        counts it in its job; the job completes with its last line. Returns the job's status when this finished it
        (else None)."""
        ok = result["status"] == "ok"
        usage = result.get("usage") or {}
        now = time.time()
        with self.engine.begin() as db:
            mine = db.execute(lines.update().where(
                lines.c.job_id == claim.job_id, lines.c.line_index == claim.line_index, lines.c.holder == holder,
                lines.c.state == "claimed").values(state="done", holder=None, lease_until=None,
                                                   result=json.dumps(result))).rowcount == 1
            if not mine:  # (its lease ran out and another gateway has it now: theirs is the result)
                return None
            db.execute(jobs.update().where(jobs.c.id == claim.job_id).values(
                completed=jobs.c.completed + int(ok), failed=jobs.c.failed + int(not ok),
                input_tokens=jobs.c.input_tokens + int(usage.get("input_tokens", 0)),
                output_tokens=jobs.c.output_tokens + int(usage.get("output_tokens", 0))))
            done = db.execute(jobs.update().where(
                jobs.c.id == claim.job_id, jobs.c.status == "processing",
                jobs.c.completed + jobs.c.failed >= jobs.c.total).values(
                status="completed", completed_at=now, expires_at=now + retention_s)).rowcount == 1
        return "completed" if done else None

    def results(self, job_id: str, page: int = 1000) -> Iterator[tuple[int, str | None, str | None]]:
        """(line index, its `id` as JSON, its result line or None when it never ran) in input order, a page of rows
        read at a time."""
        after = -1
        while True:
            with self.engine.begin() as db:
                rows = db.execute(sa.select(lines.c.line_index, lines.c.line_id, lines.c.result).where(
                    lines.c.job_id == job_id, lines.c.line_index > after).order_by(lines.c.line_index)
                    .limit(page)).all()
            yield from rows
            if len(rows) < page:
                return
            after = rows[-1].line_index

    # housekeeping

    def expired(self, now: float) -> list[dict]:
        with self.engine.begin() as db:
            return [dict(r) for r in db.execute(jobs.select().where(jobs.c.expires_at < now)).mappings()]

    def delete_job(self, job_id: str) -> None:
        with self.engine.begin() as db:
            db.execute(lines.delete().where(lines.c.job_id == job_id))
            db.execute(jobs.delete().where(jobs.c.id == job_id))

    def inputs_in_use(self) -> set[str]:
        """The input files of jobs still chunking or processing (the others' are deleted)."""
        with self.engine.begin() as db:
            return set(db.execute(sa.select(jobs.c.input_path).where(
                jobs.c.status.in_(("chunking", "processing")))).scalars())

    def jobs_by_state(self) -> dict[str, int]:
        with self.engine.begin() as db:
            counts = dict(db.execute(sa.select(jobs.c.status, sa.func.count()).group_by(jobs.c.status)).all())
        return {state: counts.get(state, 0) for state in JOB_STATES}

    def size_bytes(self) -> int | None:
        """The database's size on disk (SQLite: its files; PostgreSQL: the database's)."""
        if self.sqlite:
            path = self.url.database
            return sum(os.path.getsize(p) for p in (path, path + "-wal") if path and os.path.exists(p))
        with self.engine.begin() as db:
            return int(db.execute(sa.text("SELECT pg_database_size(current_database())")).scalar())

    def _locked(self, query):
        """Rows other gateways are claiming are skipped, not waited for (PostgreSQL; SQLite holds its write lock)."""
        return query if self.sqlite else query.with_for_update(skip_locked=True)


def _update_lines(db, claims: list[Claim], *where, **values) -> None:
    """Sets `values` on the rows of these claims' lines where `where` also holds (one statement a job)."""
    for job_id in {c.job_id for c in claims}:
        db.execute(lines.update().where(lines.c.job_id == job_id, lines.c.line_index.in_(
            [c.line_index for c in claims if c.job_id == job_id]), *where).values(**values))


def _sqlite_pragmas(connection, _record) -> None:
    connection.isolation_level = None  # (SQLAlchemy's begin hook issues BEGIN IMMEDIATE itself)
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
