"""The gateway's HTTP application (Starlette): routes, API keys, errors, metrics, health.

Each request is one call of the moondream model over its own gRPC stream to the replica upstream.py picks. A
client that goes away cancels its call (its KV pages come back on the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import moondream_api, openai_chat, playground
from .batch.routes import BatchConfig
from .errors import ApiError
from .keys import ApiKeys
from .openapi import schema
from .payloads import Limits, json_body
from .upstream import Upstream

log = logging.getLogger("kestrel.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class GatewayConfig:
    upstream: Upstream
    served: list[str]  # model names the `model` field may take (the first is the default)
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # none: open (keep it behind an ingress)
    limits: Limits = field(default_factory=Limits)
    request_timeout_s: float = 300.0
    batch: BatchConfig | None = None  # the Batch API (--batch-data); None: its routes answer 404


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("kestrel_gateway_requests_total", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("kestrel_gateway_request_duration_seconds", "Time to the response's headers (to "
                                 "the last event for streams), by endpoint", ["endpoint"], registry=self.registry)
        self.upstream = Counter("kestrel_gateway_upstream_requests_total", "Calls of the model by replica and "
                                "outcome (served, refused: sent on to the next, unreachable, failed)",
                                ["replica", "outcome"], registry=self.registry)


def create_app(config: GatewayConfig) -> Starlette:
    metrics = Metrics()
    config.upstream.on_outcome = lambda url, outcome: metrics.upstream.labels(url, outcome).inc()
    batch = config.batch and config.batch.service(config.upstream, config.limits, config.served,
                                                  config.request_timeout_s, metrics.registry)

    def endpoint(name: str, handler, authenticated: bool = True, limited: bool = True):
        """authenticated: the caller's key is checked (where keys are set); limited: and its limits applied."""
        async def serve(request: Request) -> Response:
            t0, limits, streaming = time.perf_counter(), None, False
            try:
                try:
                    key = request.state.key = config.api_keys.check(request.headers) if authenticated else None
                    if key is not None and limited:
                        key.admit()
                        limits = key
                    response = await handler(request)
                except ApiError as e:
                    response = e.response()
                except Exception:  # a bug, not the caller's fault: still the JSON shape, and counted
                    log.exception("%s %s failed", request.method, request.url.path)
                    response = ApiError(500, "internal error").response()
                streaming = isinstance(response, StreamingResponse)
                if streaming:  # (the stream holds the key's slot until its last event)
                    response.body_iterator = _timed(response.body_iterator, metrics, name, t0, limits)
                else:
                    metrics.latency.labels(name).observe(time.perf_counter() - t0)
                metrics.requests.labels(name, str(response.status_code)).inc()
                return response
            finally:
                if limits is not None and not streaming:
                    limits.release()
        return serve

    async def moondream(request: Request) -> Response:
        skill = request.url.path.rsplit("/", 1)[-1]
        call = await moondream_api.parse(skill, await json_body(request, config.limits), config.limits, config.served)
        bodies = config.upstream.call(call.inputs, call.key, config.request_timeout_s)
        if call.stream:
            return await _stream(moondream_api.events(skill, bodies))
        return JSONResponse(moondream_api.result(skill, await _last(bodies, request)))

    async def gaze(request: Request) -> Response:
        call = await moondream_api.parse_gaze(await json_body(request, config.limits), config.limits, config.served)
        bodies = config.upstream.call(call.inputs, call.key, config.request_timeout_s)
        return JSONResponse(moondream_api.result("gaze", await _last(bodies, request)))

    async def chat(request: Request) -> Response:
        body = await json_body(request, config.limits)
        call, model = await openai_chat.parse(body, config.limits, config.served)
        include_usage = openai_chat.include_usage(body)
        bodies = config.upstream.call(call.inputs, call.key, config.request_timeout_s)
        if call.stream:
            return await _stream(openai_chat.events(bodies, model, include_usage))
        return JSONResponse(openai_chat.completion(await _last(bodies, request), model))

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                          "owned_by": "kestrel-triton"} for name in config.served]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if config.upstream.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "no tritonserver replica is ready"}, status_code=503)

    async def scrape(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema(config.served))

    async def http_error(request: Request, e: HTTPException) -> Response:
        """Starlette's own answers (no such path, a method the path does not take) in the JSON shape, counted."""
        metrics.requests.labels("unknown", str(e.status_code)).inc()
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.url.path} does not take {request.method}"}.get(e.status_code, str(e.detail))
        headers = {"Allow": e.headers["Allow"]} if e.headers and "Allow" in e.headers else None
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code, headers=headers)

    async def batch_off(request: Request) -> Response:
        raise ApiError(404, "the Batch API is not enabled on this gateway (its operator starts it with --batch-data)")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await config.upstream.start()
        if batch is not None:
            await batch.start()
        yield
        if batch is not None:
            await batch.close()
        await config.upstream.close()

    routes = [Route(f"/v1/{skill.name}", endpoint(skill.name, moondream), methods=["POST"])
              for skill in moondream_api.ENDPOINTS]
    routes += [Route("/v1/chat/completions", endpoint("chat", chat), methods=["POST"]),
               Route("/v1/gaze", endpoint("gaze", gaze), methods=["POST"]),  # (ours: the cloud API has no gaze)
               Route("/v1/models", endpoint("models", models), methods=["GET"]),
               Route("/healthz", endpoint("healthz", health, authenticated=False), methods=["GET"]),
               Route("/readyz", endpoint("readyz", ready, authenticated=False), methods=["GET"]),
               Route("/openapi.json", endpoint("openapi", openapi, authenticated=False), methods=["GET"]),
               # the page is public (it holds no secret; its calls send the caller's key)
               Route("/playground", playground.to_page, methods=["GET"]),
               Route("/playground/", endpoint("playground", playground.page, authenticated=False), methods=["GET"]),
               Route("/playground/{name}", endpoint("playground", playground.page, authenticated=False),
                     methods=["GET"]),
               *_batch_routes(batch, endpoint, batch_off),
               # where keys are set, scraping needs one too (Prometheus: authorization credentials)
               Route("/metrics", endpoint("metrics", scrape, limited=False), methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def _batch_routes(batch, endpoint, off) -> list[Route]:
    methods = ["GET", "POST", "PUT", "DELETE"]
    if batch is None:
        return [Route(path, endpoint("batch", off), methods=methods)
                for path in ("/v1/batch", "/v1/batch/{id}", "/v1/batch/{id}/results")]
    return [Route("/v1/batch", endpoint("batch", batch.root), methods=["GET", "POST"]),
            Route("/v1/batch/{id}", endpoint("batch", batch.one), methods=methods),
            Route("/v1/batch/{id}/results", endpoint("batch_results", batch.results), methods=["GET"],
                  name="batch_results")]


async def _last(bodies, request: Request) -> dict:
    """The call's final body, or its error; cancelled if the client disconnects first."""
    async def final():
        last = None
        async for body in bodies:
            last = body
        if last is None:
            raise ApiError(502, "the server ended the request without an answer")
        return last

    task = asyncio.ensure_future(final())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():  # the client went away: the call is cancelled on its replica
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await bodies.aclose()
        raise ApiError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(events) -> Response:
    """Server-sent events, once the first is ready: an error before it (a bad request, no replica) is an HTTP error
    status; one after it is an error event."""
    try:
        first = await events.__anext__()
    except ApiError:
        await events.aclose()
        raise

    async def rest():
        yield first
        try:
            async for event in events:
                yield event
        except ApiError as e:
            yield moondream_api.sse(e.body())
        finally:
            await events.aclose()  # (the client went away: this cancels the call upstream)
    return StreamingResponse(rest(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _timed(body_iterator, metrics: Metrics, name: str, t0: float, limits=None):
    """A stream's time to its last event; the caller's concurrency slot is held until then."""
    try:
        async for part in body_iterator:
            yield part
    finally:
        metrics.latency.labels(name).observe(time.perf_counter() - t0)
        if limits is not None:
            limits.release()
