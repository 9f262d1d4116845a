"""Several gateways on one job store: a real PostgreSQL (Debian's), started on loopback by the test, and two gateways
sharing it and one data folder. Both run lines of one job; one is killed mid-job and the other finishes it, with
nothing lost or repeated."""

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import GATEWAY_KEY, _free_port, wait_until
from test_batch import b64, batch_gateway, client, png, submit

from client.metrics import metric_sum, scrape


def _postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    return found[-1].parent if found else None


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on a free loopback port (as the postgres user where the tests run as root: it refuses
    root), trusting local connections; its URL."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed (README's set-up installs Debian's postgresql)")
        pytest.skip("PostgreSQL is not installed")
    root = Path(tempfile.mkdtemp(prefix="kestrel-pg-"))
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(root, "postgres")
    port = _free_port()
    subprocess.run([*as_user, bin_dir / "initdb", "-D", root / "data", "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True)
    server = subprocess.Popen([*as_user, bin_dir / "postgres", "-D", root / "data", "-h", "127.0.0.1", "-p",
                               str(port), "-k", root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    import sqlalchemy as sa
    for _ in range(100):
        try:
            with sa.create_engine(url).connect():
                break
        except sa.exc.OperationalError:
            time.sleep(0.1)
    yield url
    server.terminate()
    server.wait(30)
    shutil.rmtree(root, ignore_errors=True)


def test_two_gateways_share_a_job_and_one_killed_mid_job_loses_nothing(triton_server, postgres, tmp_path):
    args = ("--batch-db", postgres, "--batch-lines-per-replica", "2")
    one, two = (batch_gateway(tmp_path, triton_server["grpc"], *args) for _ in range(2))
    try:
        image = b64(png(7))
        lines = [{"id": i, "skill": "query", "image": image, "question": f"Question {i % 4}?", "reasoning": False,
                  "settings": {"temperature": 0, "max_tokens": 12}} for i in range(40)]
        batch_id = submit(client(one), lines)
        wait_until(lambda: min(metric_sum(scrape(g.url + "/metrics", api_key=GATEWAY_KEY),
                                          "kestrel_gateway_batch_lines_total", outcome="ok") for g in (one, two)) >= 2,
                   "both gateways have run lines of the job")
        assert client(one).status(batch_id)["progress"]["completed"] < 40
        os.kill(one.proc.pid, signal.SIGKILL)
        one.proc.wait()

        c = client(two)  # the other gateway answers for the job it did not take
        status = c.wait(batch_id, poll_s=0.2, timeout_s=120)
        results = list(c.results(batch_id))
    finally:
        for g in (one, two):
            if g.proc.poll() is None:
                g.stop()
    assert status["status"] == "completed" and status["progress"] == {"total": 40, "completed": 40, "failed": 0}
    assert [(r["line_index"], r["id"], r["status"]) for r in results] == [(i, i, "ok") for i in range(40)]
    answers = {}
    for i, r in enumerate(results):
        assert answers.setdefault(i % 4, r["result"]["answer"]) == r["result"]["answer"]
    assert status["model"] == "moondream2"
