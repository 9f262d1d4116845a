"""The Batch API's client (the gateway's /v1/batch, in the cloud's shapes) and `python -m client batch`:

    python -m client batch run IMAGES_DIR --skill caption --length short --out captions.jsonl
    python -m client batch submit requests.jsonl          # prints the batch id
    python -m client batch status|wait|results|abort ID   # results: --out FILE (else stdout)

`run` captions (or queries, detects, points) every image under a folder: it sends them as jobs of --job-lines
lines, shows a progress bar, and appends each image's result line to --out once. Run it again after an interruption:
jobs it had sent are waited for and collected, images already in --out are skipped.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import httpx
from tqdm import tqdm

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}
FINISHED = ("completed", "failed", "aborted")


class BatchError(RuntimeError):
    pass


class BatchClient:
    def __init__(self, url: str = "http://localhost:2020", api_key: str | None = None, part_bytes: int = 50 * 2**20,
                 timeout: float = 600.0):
        headers = {"X-Moondream-Auth": api_key} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)
        self.part_bytes = part_bytes

    def _json(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:500]
            raise BatchError(f"{response.status_code}: {message}")
        return response.json()

    def submit(self, lines: Iterable[bytes], model: str | None = None) -> str:
        """Uploads the JSON lines (each without its newline) in parts of part_bytes and starts the job: its id."""
        upload = self._json(self.http.post("/v1/batch", params={"action": "mpu-create"}))
        file_id, upload_id = upload["fileId"], upload["uploadId"]
        parts, buffer = [], bytearray()
        try:
            for line in lines:
                buffer += line + b"\n"
                while len(buffer) >= self.part_bytes:
                    parts.append(self._part(file_id, upload_id, len(parts) + 1, bytes(buffer[:self.part_bytes])))
                    del buffer[:self.part_bytes]
            if buffer or not parts:
                parts.append(self._part(file_id, upload_id, len(parts) + 1, bytes(buffer)))
            body = {"parts": parts, **({"model": model} if model else {})}
            return self._json(self.http.post(f"/v1/batch/{file_id}", params={"action": "mpu-complete", "uploadId": upload_id},
                                             json=body))["id"]
        except BaseException:
            self.http.delete(f"/v1/batch/{file_id}", params={"action": "mpu-abort", "uploadId": upload_id})
            raise

    def _part(self, file_id: str, upload_id: str, number: int, data: bytes) -> dict:
        answer = self._json(self.http.put(f"/v1/batch/{file_id}", content=data, headers={
            "Content-Type": "application/octet-stream"}, params={"action": "mpu-uploadpart", "uploadId": upload_id,
                                                                "partNumber": number}))
        return {"partNumber": number, "etag": answer["etag"]}

    def status(self, batch_id: str) -> dict:
        return self._json(self.http.get(f"/v1/batch/{batch_id}"))

    def list(self, limit: int = 50, cursor: str | None = None) -> dict:
        return self._json(self.http.get("/v1/batch", params={"limit": limit, **({"cursor": cursor} if cursor else {})}))

    def abort(self, batch_id: str) -> dict:
        return self._json(self.http.delete(f"/v1/batch/{batch_id}"))

    def wait(self, batch_id: str, poll_s: float = 1.0, bar: tqdm | None = None, timeout_s: float | None = None) -> dict:
        """Until the job has finished (a TimeoutError after timeout_s, if given); bar (if given) advances by the lines
        done."""
        shown, deadline = 0, None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = self.status(batch_id)
            done = status["progress"]["completed"] + status["progress"]["failed"]
            if bar is not None:
                bar.update(done - shown)
                shown = done
            if status["status"] in FINISHED:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} has not finished after {timeout_s:g} s: {status}")
            time.sleep(poll_s)

    def results(self, batch_id: str) -> Iterator[dict]:
        """The result lines, in input order (the job must have completed or been aborted)."""
        with self.http.stream("GET", f"/v1/batch/{batch_id}/results") as response:
            if response.status_code >= 400:
                response.read()
                self._json(response)
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)


def image_lines(folder: Path, names: list[str], skill: str, fields: dict) -> Iterator[bytes]:
    for name in names:
        image = base64.b64encode((folder / name).read_bytes()).decode()
        yield json.dumps({"id": name, "skill": skill, "image": image, **fields}).encode()


def run(client: BatchClient, folder: Path, out: Path, skill: str, fields: dict, model: str | None = None,
        job_lines: int = 10_000, poll_s: float = 1.0) -> int:
    """Every image under folder answered once in out; returns how many lines were written."""
    state = out.with_name(out.name + ".jobs")  # the jobs sent and not yet collected (a rerun collects them)
    done = _answered(out)
    pending_jobs = json.loads(state.read_text()) if state.exists() else []
    images = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                    if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    todo = [name for name in images if name not in done]
    written = 0
    with tqdm(total=len(todo), unit="image", desc="batch") as bar, open(out, "a") as sink:
        for batch_id in list(pending_jobs):  # (sent by an interrupted run)
            written += _collect(client, batch_id, done, sink, bar, poll_s)
            pending_jobs.remove(batch_id)
            _save(state, pending_jobs)
        todo = [name for name in todo if name not in done]
        for start in range(0, len(todo), job_lines):
            names = todo[start:start + job_lines]
            batch_id = client.submit(image_lines(folder, names, skill, fields), model)
            pending_jobs.append(batch_id)
            _save(state, pending_jobs)
            written += _collect(client, batch_id, done, sink, bar, poll_s)
            pending_jobs.remove(batch_id)
            _save(state, pending_jobs)
    state.unlink(missing_ok=True)
    return written


def _collect(client: BatchClient, batch_id: str, done: set, sink, bar: tqdm, poll_s: float) -> int:
    status = client.wait(batch_id, poll_s, bar)
    if status["status"] == "failed":
        raise BatchError(f"batch {batch_id} failed: {status.get('error')}")
    written = 0
    for line in client.results(batch_id):
        if line.get("id") in done or (line["status"] == "error" and line["error"]["code"] == "aborted"):
            continue  # (already in the file; or never run: sent again by a later run)
        sink.write(json.dumps(line, ensure_ascii=False) + "\n")
        done.add(line.get("id"))
        written += 1
    sink.flush()
    return written


def _answered(out: Path) -> set:
    if not out.exists():
        return set()
    done = set()
    for text in out.read_text().splitlines():
        try:
            done.add(json.loads(text)["id"])
        except (ValueError, KeyError, TypeError):
            pass  # (a line cut short by an interruption: its image is sent again)
    return done


def _save(state: Path, jobs: list[str]) -> None:
    """Written whole or not at all: an interruption mid-write must not lose the jobs sent."""
    partial = state.with_name(state.name + ".partial")
    partial.write_text(json.dumps(jobs))
    os.replace(partial, state)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m client batch")
    p.add_argument("--url", default="http://localhost:2020", help="the gateway")
    p.add_argument("--api-key", help="X-Moondream-Auth (also MOONDREAM_API_KEY)")
    p.add_argument("--part-mb", type=float, default=50)
    sub = p.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", help="upload a JSONL file of requests and start it; prints the batch id")
    submit.add_argument("file")
    submit.add_argument("--model")
    for name in ("status", "wait", "abort"):
        sub.add_parser(name).add_argument("id")
    results = sub.add_parser("results", help="the result lines, in input order")
    results.add_argument("id")
    results.add_argument("--out")
    sub.add_parser("list")
    run_ = sub.add_parser("run", help="answer every image under a folder, resumably")
    run_.add_argument("images_dir")
    run_.add_argument("--skill", default="caption", choices=["caption", "query", "detect", "point", "segment"])
    run_.add_argument("--length", help="caption: short, normal or long")
    run_.add_argument("--question", help="query")
    run_.add_argument("--object", help="detect, point, segment")
    run_.add_argument("--settings", help="a JSON object, e.g. '{\"max_tokens\": 64}'")
    run_.add_argument("--model")
    run_.add_argument("--out", required=True)
    run_.add_argument("--job-lines", type=int, default=10_000, help="images a job (the cloud's limit: 100,000)")
    a = p.parse_args(argv)
    client = BatchClient(a.url, a.api_key or os.environ.get("MOONDREAM_API_KEY"), int(a.part_mb * 2**20))
    try:
        if a.command == "submit":
            with open(a.file, "rb") as f:
                print(client.submit((line.rstrip(b"\r\n") for line in f), a.model))
        elif a.command in ("status", "abort", "list"):
            answer = client.list() if a.command == "list" else getattr(client, a.command)(a.id)
            print(json.dumps(answer, indent=2))
        elif a.command == "wait":
            with tqdm(total=client.status(a.id)["progress"]["total"], unit="line") as bar:
                print(json.dumps(client.wait(a.id, bar=bar), indent=2))
        elif a.command == "results":
            sink = open(a.out, "w") if a.out else sys.stdout
            for line in client.results(a.id):
                sink.write(json.dumps(line, ensure_ascii=False) + "\n")
        else:
            fields = {k: v for k, v in (("length", a.length), ("question", a.question), ("object", a.object))
                      if v is not None}
            if a.settings:
                fields["settings"] = json.loads(a.settings)
            written = run(client, Path(a.images_dir), Path(a.out), a.skill, fields, a.model, a.job_lines)
            print(f"{written} lines written to {a.out}", file=sys.stderr)
    except BatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
