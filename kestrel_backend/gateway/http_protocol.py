"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers: a client that opens a connection and sends
its headers a byte at a time (or never) is cut off, instead of holding the connection for good (uvicorn's keep-alive
timeout restarts with every byte). The body's deadline is the application's (payloads.json_body)."""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineProtocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # (the next request on this connection)

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._header_deadline, self.cycle)

    def _header_deadline(self, cycle_then) -> None:
        """No request's headers came in since the deadline was armed (the cycle is the one of then): close."""
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()
