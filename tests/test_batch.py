"""The Batch API against a real tritonserver (tiny checkpoint, CPU) and real gateways: a job of mixed skills with bad
lines, the cloud's batch-level errors, the multipart upload, list pages, abort, another key's jobs, a gateway killed
mid-job, and `python -m client batch run` resumed after an interruption."""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import pyvips
from conftest import GATEWAY_KEY, GatewayProcess, http_request, wait_until

from client.batch import BatchClient, BatchError
from client.metrics import metric_sum, scrape

KEYS = {"KESTREL_GATEWAY_API_KEYS": f"{GATEWAY_KEY}, other-key, list-key"}
GREEDY = {"temperature": 0, "max_tokens": 4}
PART_MB = 0.25  # the gateway's part limit here: a file of a few images needs several parts
pytestmark = pytest.mark.xdist_group("batch")  # (the module's gateway started once, on one worker)


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return pyvips.Image.new_from_array(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).resize(
        4, kernel="linear").pngsave_buffer()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def batch_gateway(work: Path, triton: str, *args: str) -> GatewayProcess:
    return GatewayProcess(work, [triton], "--model-name", "moondream2", "--batch-data", str(work / "data"),
                          "--batch-max-part-mb", str(PART_MB), "--batch-max-lines", "50", "--batch-lease-s", "3",
                          *args, env=KEYS)


@pytest.fixture(scope="module")
def gateway(triton_server, tmp_path_factory):
    g = batch_gateway(tmp_path_factory.mktemp("batch"), triton_server["grpc"], "--batch-lines-per-replica", "2")
    yield g
    g.stop()


def client(gateway, key=GATEWAY_KEY, part_bytes=200_000) -> BatchClient:
    return BatchClient(gateway.url, key, part_bytes=part_bytes)


def submit(c: BatchClient, lines: list) -> str:
    return c.submit(line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines)


def test_a_job_of_mixed_skills_and_bad_lines_answers_every_line_in_order(gateway):
    image = b64(png(1))
    lines = [{"id": "caption", "skill": "caption", "image": image, "length": "short", "settings": GREEDY},
             {"id": 2, "skill": "query", "image": image, "question": "What is it?", "reasoning": False,
              "settings": GREEDY},
             {"skill": "detect", "image": image, "object": "cat", "settings": {"max_objects": 3}},
             {"id": "undecodable", "skill": "point", "image": b64(b"not an image at all"), "object": "cat"},
             {"id": "unknown", "skill": "dance", "image": image},
             {"id": "bad settings", "skill": "caption", "image": image, "settings": {"temperature": 9}},
             {"id": "no question", "skill": "query", "image": image},
             {"id": "chat", "skill": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
             {"id": "two images", "skill": "query", "images": [image, b64(png(2))], "question": "Same?",
              "settings": {"max_tokens": 4}},
             {"id": "segment", "skill": "segment", "image": image, "object": "cat"},  # (Moondream 3's skill)
             {"id": "mixed refs", "skill": "query", "image": image, "question": "This?", "reasoning": False,
              "spatial_refs": [[0.5, 0.5], [0.1, 0.1, 0.2, 0.2]]}]
    c = client(gateway)
    batch_id = submit(c, lines)
    status = c.wait(batch_id, poll_s=0.2, timeout_s=120)
    results = list(c.results(batch_id))

    assert [r["line_index"] for r in results] == list(range(len(lines)))
    assert [r.get("id") for r in results] == [line.get("id") for line in lines]
    codes = [r["error"]["code"] if r["status"] == "error" else "ok" for r in results]
    assert codes == ["ok", "ok", "ok", "image_decode_failed", "unknown_skill", "invalid_request", "invalid_request",
                     "ok", "ok", "invalid_request", "invalid_request"]
    assert "temperature" in results[5]["error"]["message"] and "question" in results[6]["error"]["message"]
    assert "Moondream 3" in results[9]["error"]["message"] and "not a mix" in results[10]["error"]["message"]
    assert {k for r in results if r["status"] == "ok" for k in r["result"]} == {"caption", "answer", "objects",
                                                                                "message", "reasoning"}
    # a batch line's answer is the interactive API's answer to the same request
    _, interactive, _ = http_request(gateway.url, "/v1/caption", {"image_url": image, "length": "short",
                                     "settings": GREEDY}, {"X-Moondream-Auth": GATEWAY_KEY})
    assert results[0]["result"]["caption"] == interactive["caption"]

    assert status["status"] == "completed" and status["progress"] == {"total": 11, "completed": 5, "failed": 6}
    assert status["usage"] == {k: sum(r["usage"][k] for r in results if r["status"] == "ok")
                               for k in ("input_tokens", "output_tokens")}
    assert status["outputs"][0]["url"].endswith(f"/v1/batch/{batch_id}/results")
    metrics = scrape(gateway.url + "/metrics", api_key=GATEWAY_KEY)
    assert metric_sum(metrics, "kestrel_gateway_batch_lines_total", outcome="unknown_skill") >= 1
    assert metric_sum(metrics, "kestrel_gateway_batch_lines_total", outcome="ok") >= 5
    # the gauges follow at the next heartbeat (a third of the 3 s lease): jobs by state, the data folder's bytes
    wait_until(lambda: metric_sum(scrape(gateway.url + "/metrics", api_key=GATEWAY_KEY), "kestrel_gateway_batch_jobs",
                                  state="completed") >= 1, "the completed job in the gauges", 10, poll=0.2)
    metrics = scrape(gateway.url + "/metrics", api_key=GATEWAY_KEY)
    assert metric_sum(metrics, "kestrel_gateway_batch_disk_bytes", where="data_folder") > 0
    assert not list((Path(gateway.log).parent / "data" / "inputs").glob("*.jsonl"))  # (inputs go once processed)


@pytest.mark.parametrize("content, code", [
    (b'{"skill": "caption"}\n\n{"skill": "caption"}\n', "validation_error"),  # a blank line
    (b'{"skill": "caption"}\nnot json\n', "validation_error"),
    (b'{"skill": "caption", "question": "\xff"}\n', "validation_error"),  # not UTF-8
    (b'["a list"]\n', "validation_error"),
    (b'{"skill": "caption"}\n' * 51, "limit_exceeded"),  # over --batch-max-lines 50
    (b"", "empty_batch")])
def test_a_file_the_cloud_would_refuse_fails_its_job_with_the_clouds_code(gateway, content, code):
    c = client(gateway)
    batch_id = c.submit(iter(content.split(b"\n")[:-1]) if content else iter(()))
    status = c.wait(batch_id, poll_s=0.1, timeout_s=120)
    assert status["status"] == "failed" and status["error"]["code"] == code, status
    with pytest.raises(BatchError, match="409"):
        list(c.results(batch_id))


def test_a_file_over_one_part_goes_through_the_multipart_upload(gateway):
    lines = [json.dumps({"id": i, "skill": "caption", "image": b64(png(10 + i) * 40), "settings": GREEDY}).encode()
             for i in range(6)]
    data = b"\n".join(lines) + b"\n"
    assert len(data) > 2 * PART_MB * 2**20
    headers = {"X-Moondream-Auth": GATEWAY_KEY}
    _, upload, _ = http_request(gateway.url, "/v1/batch?action=mpu-create", method="POST", headers=headers, raw=b"")
    part = f"/v1/batch/{upload['fileId']}?action=mpu-uploadpart&uploadId={upload['uploadId']}&partNumber=1"
    for framing in ("declared", "chunked"):  # the whole file as one part: refused by its length, or as it comes
        answer = _put_raw(gateway, part, data, framing)
        assert answer.startswith(b"HTTP/1.1 413") and b"limit_exceeded" in answer, answer[:300]
    # a part whose etag is not the one the gateway gave is refused at completion
    status, part, _ = http_request(gateway.url, f"/v1/batch/{upload['fileId']}?action=mpu-uploadpart&uploadId="
                                   f"{upload['uploadId']}&partNumber=1", method="PUT", headers=headers, raw=lines[0])
    status, body, _ = http_request(gateway.url, f"/v1/batch/{upload['fileId']}?action=mpu-complete&uploadId="
                                   f"{upload['uploadId']}", {"parts": [{"partNumber": 1, "etag": '"0000"'}]},
                                   headers=headers)
    assert status == 400 and "etag" in body["error"]["message"]

    c = client(gateway, part_bytes=int(PART_MB * 2**20))  # parts of the gateway's limit, a line across two
    batch_id = c.submit(iter(lines))
    status = c.wait(batch_id, poll_s=0.2, timeout_s=120)
    assert status["status"] == "completed" and status["size"] == len(data)
    assert [r["status"] for r in c.results(batch_id)] == ["ok"] * 6


def _put_raw(gateway, path: str, data: bytes, framing: str) -> bytes:
    """The answer to a PUT of data: its headers alone with its Content-Length, or the data in chunks (sending
    stops where the gateway has answered: it refuses without reading the rest)."""
    host, port = gateway.url.rsplit("/", 1)[-1].split(":")
    length = f"Content-Length: {len(data)}" if framing == "declared" else "Transfer-Encoding: chunked"
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nX-Moondream-Auth: {GATEWAY_KEY}\r\n{length}\r\n\r\n"
                  .encode())
        try:
            for start in range(0, len(data) if framing == "chunked" else 0, 65536):  # (declared: headers alone)
                chunk = data[start:start + 65536]
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # (refused: the gateway closed its side)
        answer = b""
        while b"limit_exceeded" not in answer and (chunk := s.recv(4096)):
            answer += chunk
    return answer


def test_list_pages_newest_first_with_a_cursor_and_keys_see_only_their_jobs(gateway):
    c = client(gateway, key="list-key")
    ids = [submit(c, [{"skill": "caption"}]) for _ in range(3)]
    first = c.list(limit=2)
    assert [b["id"] for b in first["batches"]] == ids[::-1][:2] and first["has_more"]
    second = c.list(limit=2, cursor=first["next_cursor"])
    assert [b["id"] for b in second["batches"]] == ids[:1] and not second["has_more"]
    assert second["next_cursor"] is None

    other = client(gateway, key="other-key")
    assert ids[0] not in [b["id"] for b in other.list()["batches"]]
    for call in (lambda: other.status(ids[0]), lambda: other.abort(ids[0]), lambda: list(other.results(ids[0]))):
        with pytest.raises(BatchError, match="404"):
            call()
    with pytest.raises(BatchError, match="401"):
        client(gateway, key="wrong-key").list()


def test_abort_stops_a_job_and_says_how_far_it_got(gateway):
    c = client(gateway)
    image = b64(png(3))
    lines = [{"id": i, "skill": "query", "image": image, "question": f"Question {i}?", "reasoning": False,
              "settings": {"temperature": 0, "max_tokens": 24}} for i in range(40)]
    batch_id = submit(c, lines)
    wait_until(lambda: c.status(batch_id)["progress"]["completed"] >= 2, "two lines completed")
    aborted = c.abort(batch_id)
    assert aborted["status"] == "aborted" and aborted["progress"]["completed"] < 40
    time.sleep(2.5)  # (two heartbeats, a third of the 3 s lease each: lines in flight at the abort are let go)
    final = c.status(batch_id)
    assert final["status"] == "aborted"
    assert final["progress"]["completed"] <= aborted["progress"]["completed"] + 3  # (2 upstream, 1 read ahead)
    results = list(c.results(batch_id))
    assert [r["line_index"] for r in results] == list(range(40))
    ran = [r for r in results if r["status"] == "ok"]
    assert len(ran) == final["progress"]["completed"]
    assert all(r["error"]["code"] == "aborted" for r in results if r["status"] != "ok")


def test_a_small_job_of_another_key_is_not_held_back_by_a_large_one(gateway):
    """Lines are shared between API keys by the lines each has running, not first come first served: a 3-line job
    of another key, submitted once a 24-line job runs, finishes while the large one is still far from done."""
    image = b64(png(5))
    large, small = client(gateway), client(gateway, key="other-key")
    large_id = submit(large, [{"skill": "query", "image": image, "question": f"Question {i}?", "reasoning": False,
                               "settings": {"temperature": 0, "max_tokens": 12}} for i in range(24)])
    try:
        wait_until(lambda: large.status(large_id)["progress"]["completed"] >= 1, "a line of the large job completed")
        small_id = submit(small, [{"skill": "caption", "image": image, "settings": GREEDY} for _ in range(3)])
        assert small.wait(small_id, poll_s=0.05, timeout_s=120)["progress"]["completed"] == 3
        assert large.status(large_id)["progress"]["completed"] <= 16  # (first come first served: all 24)
    finally:
        large.abort(large_id)


def test_a_gateway_killed_mid_job_and_started_again_finishes_it_with_nothing_lost_or_repeated(triton_server,
                                                                                            tmp_path):
    args = ("--batch-lines-per-replica", "2")
    first = batch_gateway(tmp_path, triton_server["grpc"], *args)
    image = b64(png(4))
    lines = [{"id": f"line {i}", "skill": "query", "image": image, "question": f"Question {i % 3}?",
              "reasoning": False, "settings": {"temperature": 0, "max_tokens": 12}} for i in range(30)]
    c = client(first)
    batch_id = submit(c, lines)
    wait_until(lambda: c.status(batch_id)["progress"]["completed"] >= 6, "six lines completed")
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()

    again = batch_gateway(tmp_path, triton_server["grpc"], *args)
    try:
        c = client(again)
        status = c.wait(batch_id, poll_s=0.2, timeout_s=120)
        results = list(c.results(batch_id))
    finally:
        again.stop()
    assert status["status"] == "completed" and status["progress"] == {"total": 30, "completed": 30, "failed": 0}
    assert [(r["line_index"], r["id"], r["status"]) for r in results] == [(i, f"line {i}", "ok") for i in range(30)]
    answers = {}
    for i, r in enumerate(results):  # greedy: one question, one answer, whichever gateway ran it
        assert answers.setdefault(i % 3, r["result"]["answer"]) == r["result"]["answer"]


def test_client_batch_run_writes_every_image_once_and_resumes_after_an_interruption(gateway, tmp_path):
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    names = [f"{i:02d}.png" for i in range(10)] + ["sub/10.png", "sub/11.png"]
    for i, name in enumerate(names):
        (folder / name).write_bytes(png(100 + i))
    (folder / "notes.txt").write_text("not an image")
    out = tmp_path / "captions.jsonl"
    cmd = [sys.executable, "-m", "client", "batch", "--url", gateway.url, "--api-key", GATEWAY_KEY, "run",
           str(folder), "--skill", "caption", "--length", "short", "--settings", json.dumps(GREEDY),
           "--out", str(out), "--job-lines", "4"]
    out.write_text(json.dumps({"id": "sub/11.png", "status": "ok", "result": {"caption": "answered before"}}) + "\n")
    state = out.with_name(out.name + ".jobs")
    interrupted = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, cwd=Path(__file__).parents[1])
    def first_job_sent():  # (the state file is replaced whole)
        assert interrupted.poll() is None, "the run ended before it could be interrupted"
        return state.exists() and json.loads(state.read_text())

    wait_until(first_job_sent, "the run's first job sent", poll=0.01)  # then it is killed
    interrupted.kill()  # (SIGKILL: no clean-up at all; xdist's workers pass SIGINT on ignored)
    assert interrupted.wait(30) == -signal.SIGKILL and len(out.read_text().splitlines()) < len(names)

    again = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert again.returncode == 0, again.stderr
    assert "it/s" in again.stderr or "image/s" in again.stderr  # (the progress bar: its rate)
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(names)  # each image once
    assert all(r["status"] == "ok" and r["result"]["caption"] for r in results)
    assert results[0]["result"]["caption"] == "answered before"  # (an image already in the file is not sent)
    assert not state.exists()


def test_a_line_whose_gateway_no_longer_runs_it_is_not_renewed_and_runs_again(tmp_path):
    """The heartbeat renews the lines its gateway still runs, not every line it once claimed: a line whose result
    could not be recorded (the store failed) returns to the pool when its lease lapses, so the job still completes."""
    from kestrel_backend.gateway.batch.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path / 'batch.db'}")
    store.create_job("job", "key", "moondream2", 10, str(tmp_path / "input.jsonl"), "gateway", 30)
    store.add_lines("job", [(0, 5, None), (5, 5, None)], 0)
    assert store.start_processing("job", "gateway", 2)
    running, orphaned = store.claim("gateway", 2, lease_s=1)
    store.renew("gateway", 30, [running])
    assert store.claim("another gateway", 2, 30) == []
    time.sleep(1.2)
    assert [c.line_index for c in store.claim("another gateway", 2, 30)] == [orphaned.line_index]
    store.close()



def test_a_claim_among_many_live_jobs_counts_the_lines_of_few_and_shares_fairly(tmp_path):
    """Two API keys, one with 200 jobs of 2 lines processing, the other with one: a claim of 8 lines gives the second
    key both its lines and the first its oldest jobs' (one at a time to the key with fewer running), and counts the
    claimable lines of the 4 jobs it takes from, not of all 201 (a query each, on every claim)."""
    import sqlalchemy as sa

    from kestrel_backend.gateway.batch.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path / 'batch.db'}")
    for i in range(201):
        job_id, key = (f"job{i:03d}", "many") if i < 200 else ("last", "one")
        store.create_job(job_id, key, "moondream2", 10, str(tmp_path / "input.jsonl"), "gateway", 30)
        store.add_lines(job_id, [(0, 5, None), (5, 5, None)], 0)
        assert store.start_processing(job_id, "gateway", 2)
    statements = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    claimed = store.claim("gateway", 8, 30)
    assert sorted((c.job_id, c.line_index) for c in claimed) == [
        (job, line) for job in ("job000", "job001", "job002", "last") for line in (0, 1)]
    assert sum("count(" in statement.lower() for statement in statements) == 1 + 4  # (the lines running by key)
    store.close()


def test_the_data_folders_bound_counts_parts_let_in_before_they_are_written(tmp_path, monkeypatch):
    """Parts let in but not yet written count against --batch-max-disk-gb (the folder is walked at most once a
    second, not at each part): a burst of parts cannot pass the bound between two walks."""
    from kestrel_backend.gateway.batch import files
    from kestrel_backend.gateway.batch.limits import BatchLimits
    from kestrel_backend.gateway.errors import ApiError

    folder = files.DataFolder(tmp_path, BatchLimits(max_disk_bytes=1000))
    (tmp_path / "inputs" / "job.jsonl").write_bytes(b"x" * 400)
    folder.check_room(500)
    with pytest.raises(ApiError) as refused:
        folder.check_room(200)  # (400 on disk, 500 on their way)
    assert refused.value.status == 507 and refused.value.code == "limit_exceeded"
    (tmp_path / "uploads" / "part").write_bytes(b"x" * 500)
    monkeypatch.setattr(files, "USAGE_TTL_S", 0.0)
    assert folder.bytes_used() == 900  # (walked again: the part is on disk, no longer counted twice)
