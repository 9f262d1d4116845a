"""The stop probe: where it finds tritonserver's HTTP endpoint, and what it takes for a stop."""

import http.server
import threading

from kestrel_backend.server.stop_probe import StopProbe, readiness_url

SERVER = "/opt/tritonserver/bin/tritonserver"


def test_readiness_url_follows_the_servers_command_line():
    assert readiness_url([SERVER, "--model-repository=/models"], "moondream") == \
        "http://127.0.0.1:8000/v2/models/moondream/ready"
    assert readiness_url([SERVER, "--http-port", "9100", "--grpc-port=9101"], "md") == \
        "http://127.0.0.1:9100/v2/models/md/ready"
    assert readiness_url([SERVER, "--http-address=10.1.2.3", "--http-port=81"], "md") == \
        "http://10.1.2.3:81/v2/models/md/ready"
    assert readiness_url([SERVER, "--http-address", "::"], "md") == "http://[::1]:8000/v2/models/md/ready"
    assert readiness_url([SERVER, "--allow-http=false"], "md") is None
    assert readiness_url([SERVER, "--allow-http", "0", "--http-port=81"], "md") is None


class _Readiness(http.server.BaseHTTPRequestHandler):
    status = 400  # class-wide: what the "server" answers now

    def do_GET(self):
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_stop_is_a_ready_model_that_turns_not_ready_or_whose_endpoint_closes():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readiness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v2/models/moondream/ready"

    loading = StopProbe(url)
    _Readiness.status = 400
    assert not loading.stopping()  # not ready before it was ever ready: still loading, not stopping

    unloaded, exited = StopProbe(url), StopProbe(url)
    _Readiness.status = 200
    assert not unloaded.stopping() and not exited.stopping()
    _Readiness.status = 400
    assert unloaded.stopping()
    server.shutdown()
    server.server_close()
    assert exited.stopping()  # connection refused: the server has closed its endpoint
