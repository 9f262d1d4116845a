"""The tritonservers behind the gateway, and which one serves a request.

Each request goes to the replica that rendezvous hashing of its key (the image's digest and the adapter) ranks
first, so questions on one image reach the engine whose prefix cache holds it; a replica with more than its share
of the requests in flight (bounded load: 1.25 times the mean, plus 2) passes it to the next in rank. A replica that is not
ready (stopping, unreachable) gets no new request. A request that a replica turned away before running it (it is
draining or its queue is full, or the connection was refused) goes to the next; one that a replica failed while
running it ends with an error, never sent twice.

Replicas come from a list of host:port, from a file of them (one a line, read again every few seconds: a mounted
ConfigMap), or from a DNS name (a Kubernetes headless Service) resolved again every few seconds, each address a
replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import tritonclient.grpc.aio as grpcaio

from client import response_body
from .errors import ApiError, all_refused, from_triton, refused_before_admission

log = logging.getLogger("kestrel.gateway")
LOAD_BOUND = 1.25  # a replica takes a request while it has at most this times the mean in flight,
LOAD_SLACK = 2  # plus this many: at a few requests in flight the bound alone would scatter an image's questions
READY_WAIT_S = 5.0  # with no replica ready (a rolling restart's worst moment, a busy host's late probes), a request
# waits this long for one, asking them again, before it is answered 503


@dataclass(eq=False)
class Replica:
    url: str
    client: grpcaio.InferenceServerClient
    ready: bool = False
    inflight: int = 0
    avoid_until: float = 0.0  # after it refused a request (draining, overloaded): none for a moment

    def available(self, now: float) -> bool:
        return self.ready and now >= self.avoid_until


def replica_client(url: str) -> grpcaio.InferenceServerClient:
    """tritonclient's channel options, with reconnection after at most a second: gRPC's default backoff grows to two
    minutes while a restarting server refuses connections, and kept a replica that was back out of the rotation for
    10 s and more (measured in a rolling restart of three), long enough for the next one to go down meanwhile."""
    ka = grpcaio.KeepAliveOptions()
    return grpcaio.InferenceServerClient(url, channel_args=[
        ("grpc.max_send_message_length", grpcaio.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcaio.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", ka.keepalive_time_ms), ("grpc.keepalive_timeout_ms", ka.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", ka.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", ka.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000)])


def rendezvous_order(key: str, replicas: list[Replica]) -> list[Replica]:
    """Highest-random-weight order: each replica's score is a hash of (key, replica); a replica that joins or leaves
    moves only the keys it wins or held."""
    return sorted(replicas, key=lambda r: hashlib.blake2b(f"{key}|{r.url}".encode(), digest_size=8).digest(),
                  reverse=True)


@dataclass
class Upstream:
    model: str
    addresses: list[str] = field(default_factory=list)  # host:port
    dns: str | None = None  # name:port, resolved every refresh_s
    listing: str | None = None  # a file of host:port lines, read every refresh_s
    refresh_s: float = 2.0
    replicas: dict[str, Replica] = field(default_factory=dict)
    on_outcome: Callable[[str, str], None] = lambda url, outcome: None  # (replica, served|refused|unreachable|failed)
    _probing: asyncio.Future | None = field(default=None, init=False, repr=False)  # (see _probe_unready)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._keep_fresh())

    async def close(self) -> None:
        self._task.cancel()
        for r in self.replicas.values():
            await r.client.close()

    async def _keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # (a failed look-up keeps the replicas it had)
                log.exception("refreshing the replicas failed")

    async def refresh(self) -> None:
        """Replicas from the list or DNS; each asked whether its model is ready."""
        urls = list(self.addresses)
        if self.listing:
            urls += [line.split("#")[0].strip() for line in Path(self.listing).read_text().splitlines()]
            urls = [u for u in urls if u]
        if self.dns:
            host, _, port = self.dns.rpartition(":")
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            urls += sorted({f"{info[4][0]}:{port}" for info in infos})
        for url in set(urls) - set(self.replicas):
            self.replicas[url] = Replica(url, replica_client(url))
        for url in set(self.replicas) - set(urls):
            gone = self.replicas.pop(url)
            if not gone.inflight:
                await gone.client.close()
        await asyncio.gather(*[self._probe(r) for r in self.replicas.values()])

    async def _probe(self, replica: Replica) -> None:
        """Its answer, or not ready when it cannot be reached; a probe that only ran late (a busy host) changes
        nothing: it had taken healthy replicas out of the rotation during a rolling restart."""
        was = replica.ready
        try:
            replica.ready = await asyncio.wait_for(replica.client.is_model_ready(self.model), 2.0)
        except asyncio.TimeoutError:
            pass
        except Exception as e:
            replica.ready = False
            if was:
                log.info("replica %s unreachable: %s", replica.url, str(e)[:200])
        if replica.ready != was:
            log.info("replica %s %s", replica.url, "ready" if replica.ready else "not ready")

    async def _choices_when_ready(self, key: str | None) -> list[Replica]:
        """The replicas to try; with none ready now, asked again until one is or READY_WAIT_S has passed."""
        choices, deadline = self.choices(key), time.monotonic() + READY_WAIT_S
        while not choices and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            await self._probe_unready()
            choices = self.choices(key)
        return choices

    async def _probe_unready(self) -> None:
        """Ask the replicas that are not ready again: one round at a time, which every waiting request joins (a
        cancelled request leaves it running for the others)."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.gather(*[self._probe(r) for r in list(self.replicas.values()) if not r.ready])
        await asyncio.shield(self._probing)

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas.values())

    def choices(self, key: str | None) -> list[Replica]:
        """The replicas to try, in order: by rendezvous rank of the key (no key: fewest in flight first), those
        over the load bound moved behind the others."""
        now = time.monotonic()
        live = [r for r in self.replicas.values() if r.available(now)]
        if not live:
            return []
        ranked = rendezvous_order(key, live) if key else sorted(live, key=lambda r: r.inflight)
        bound = math.ceil(LOAD_BOUND * (sum(r.inflight for r in live) + 1) / len(live)) + LOAD_SLACK
        return [r for r in ranked if r.inflight < bound] + [r for r in ranked if r.inflight >= bound]

    async def call(self, inputs, key: str | None, timeout: float):
        """The moondream model's JSON bodies for one request (on its own gRPC stream), as they come. Closing the
        generator early (the HTTP client went away) cancels the request on its replica."""
        tried, refusals = [], []
        for replica in await self._choices_when_ready(key):
            tried.append(replica.url)
            replica.inflight += 1
            responses, answered = None, False
            try:
                responses = replica.client.stream_infer(_one_request(self.model, inputs), stream_timeout=timeout)
                async for result, error in responses:
                    if error is not None or _final(result):
                        # the stream's end before anything else (the server ends it right after its final
                        # response, and an error is one): a cancel racing that end leaves tritonserver 2.51 waiting
                        # for a callback that never comes, the model stays loaded, and a stop waits out the exit
                        # timeout. (A caller that leaves once it has the answer closes this generator at once.)
                        async for _ in responses:
                            pass
                    if error is not None:
                        message = error.message()
                        if not answered and refused_before_admission(message):
                            replica.avoid_until = time.monotonic() + 1.0
                            self.on_outcome(replica.url, "refused")
                            refusals.append(message)
                            break  # to the next replica
                        self.on_outcome(replica.url, "failed")
                        raise from_triton(message)
                    body = response_body(result)
                    if body is not None:
                        answered = True
                        yield body
                else:
                    self.on_outcome(replica.url, "served")
                    return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise ApiError(504, f"the server did not answer within {timeout:g} s") from None
                if answered or not _never_connected(e):
                    self.on_outcome(replica.url, "failed")
                    raise ApiError(502, f"replica {replica.url} failed while serving the request: "
                                        f"{e.code().name}: {e.details()}") from None
                replica.ready = False  # refused the connection: to the next replica
                log.info("replica %s refused a connection: %s", replica.url, (e.details() or "")[:200])
                self.on_outcome(replica.url, "unreachable")
            finally:
                replica.inflight -= 1
                if responses is not None:
                    responses.cancel()  # (a no-op once the stream ended; cancels the request when the caller left)
        if not tried:
            raise ApiError(503, "no tritonserver replica is ready", retry_after=1)
        raise all_refused(refusals)


async def _one_request(model: str, inputs):
    yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex}


def _final(result) -> bool:
    flag = result.get_response().parameters.get("triton_final_response")
    return flag is not None and flag.bool_param


def _never_connected(error: grpc.aio.AioRpcError) -> bool:
    """The replica refused the connection, so it never saw the request (safe to send elsewhere)."""
    details = (error.details() or "").lower()
    return error.code() == grpc.StatusCode.UNAVAILABLE and ("failed to connect" in details or
                                                          "connection refused" in details)
