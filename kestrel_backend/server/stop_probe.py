"""How the model learns that tritonserver is stopping: this model's readiness, asked over tritonserver's HTTP port.

The Python backend tells a model nothing before finalize(), and finalize() waits for the requests in flight, so the
model has to ask. pb_utils.is_model_ready is not safe for that: once the server is exiting the call fails, and on its
failure path the stub reads the error text from shared memory that tritonserver frees as soon as the stub has been
answered (python_backend's Stub::SendMessage). Under load, about one stop in ten crashed the stub there (SIGSEGV),
and tritonserver then waited out its exit timeout and aborted, with every admitted request lost. An HTTP request to
the server's own endpoint has no such failure path: a refused connection or a "not ready" answer both mean stopping.

The port is tritonserver's own: the stub is its child, so the server's command line (/proc/<parent>/cmdline) says
whether HTTP is on and where (`--allow-http`, `--http-address`, `--http-port`; Triton's defaults otherwise).
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

TRITON_HTTP_PORT = 8000  # tritonserver's default


def server_options(argv: list[str]) -> dict[str, str]:
    """tritonserver's `--name=value` and `--name value` options, by name."""
    options, i = {}, 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            options[name] = value
        i += 1
    return options


def readiness_url(argv: list[str], model_name: str) -> str | None:
    """The URL of this model's readiness on the server started with argv; None when its HTTP endpoint is off."""
    options = server_options(argv)
    if options.get("allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    host = options.get("http-address", "0.0.0.0")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host)
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    port = int(options.get("http-port", TRITON_HTTP_PORT))
    return f"http://{host}:{port}/v2/models/{model_name}/ready"


class StopProbe:
    """stopping() turns true once the model, having been ready, is not: the server exits or unloads it."""

    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url, self.timeout_s = url, timeout_s
        self._seen_ready = False  # the model is not ready while it loads: only ready, then not ready, means a stop

    @classmethod
    def for_parent_server(cls, model_name: str) -> StopProbe | None:
        """The probe for the tritonserver that started this process; None if it serves no HTTP."""
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:
            return None
        url = readiness_url(argv, model_name)
        return cls(url) if url else None

    def stopping(self) -> bool:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                ready = response.status == 200
        except urllib.error.HTTPError:  # 400: not ready (being unloaded), or the server is exiting
            ready = False
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ConnectionRefusedError):
                return False  # a timeout on a loaded machine says nothing about a stop: ask again next round
            ready = False  # the endpoint has closed: the server is exiting
        except OSError:  # (a timeout while reading the answer, likewise)
            return False
        self._seen_ready |= ready
        return self._seen_ready and not ready
