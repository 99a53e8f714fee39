"""OpenTelemetry traces of a request across router, prefill pod and decode pod: the one place they are set up.

On only when an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and neither ``OTEL_SDK_DISABLED=true`` nor
``OTEL_TRACES_EXPORTER=none`` says otherwise. Everything else comes from the standard variables
as the SDK reads them: ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` (the resource),
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on),
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``, the only one installed),
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*`` (the batch processor).

Off, it costs nothing: the OpenTelemetry packages are not even imported, `span` hands back one
shared no-op context manager, `instrument` adds no middleware, and `inject` leaves headers alone.

Where the spans come from:

* every proxied/served OpenAI request gets a server span (`instrument`: an ASGI middleware, so a
  streamed answer's span lasts until its last byte) whose parent is the client's W3C
  ``traceparent`` when it sent one;
* the router adds admission (queue wait), the routing decision, the prefill call and the decode
  call (services/router/router.py), and passes ``traceparent`` on in every request to a pod
  (`inject`, services/router/upstream.py);
* each pod's API server adds, after the fact and from timestamps the engine sends with a
  sequence's first token, the engine's view: queue, KV transfer (bytes, connector), prefill
  compute, decode (`engine_spans`). Nothing runs in the engine loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("kvmesh.tracing")

_tracer: Tracer | None = None
_provider: Any = None
_NULL = contextlib.nullcontext()


def configured(environ: dict[str, str] | None = None) -> bool:
    """Whether the ``OTEL_*`` variables ask for traces to be exported."""
    e = os.environ if environ is None else environ
    if e.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if e.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(e.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or e.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def enabled() -> bool:
    return _tracer is not None


def setup(default_service: str, exporter: Any = None) -> bool:
    """Start exporting spans if the environment asks for it (idempotent; True when on).

    ``default_service``: the service name when ``OTEL_SERVICE_NAME`` is unset (``kvmesh-router``,
    ``kvmesh-<role>``). ``exporter``: a span exporter to use instead of OTLP (tests)."""
    global _tracer, _provider
    if _tracer is not None:
        return True
    if exporter is None and not configured():
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service}
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler: OTEL_TRACES_SAMPLER
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("kvmesh")
    log.info("exporting OpenTelemetry traces as %s", provider.resource.attributes.get(SERVICE_NAME))
    return True


def shutdown() -> None:
    """Flush what is buffered and stop (process exit; tests)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


# ---- spans ----------------------------------------------------------------------------------------
def span(name: str, attributes: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[Span | None]:
    """A child span of the current one, current within the ``with`` (so a pod call inside carries it as
    ``traceparent``); off: a shared no-op yielding None."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=attributes)


@contextlib.contextmanager
def opened(name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span | None]:
    """A span current within the ``with`` that stays open after it (ended later with `ending`) unless
    the block raises: for a call whose answer streams on after the code that made it returns."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import trace

    s = _tracer.start_span(name, attributes=attributes)
    try:
        with trace.use_span(s, end_on_exit=False, record_exception=True, set_status_on_exception=True):
            yield s
    except BaseException:
        s.end()
        raise


def ending(s: Span | None, then: Callable[[int | None], None] | None) -> Callable[[int | None], None] | None:
    """``then`` preceded by ending span ``s`` (a callback that runs when an answer is over)."""
    if s is None:
        return then

    def done(total: int | None) -> None:
        if total is not None:
            s.set_attribute("kvmesh.total_tokens", total)
        s.end()
        if then is not None:
            then(total)

    return done


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (None values skipped); off: nothing."""
    if _tracer is None:
        return
    from opentelemetry import trace

    s = trace.get_current_span()
    if s.is_recording():
        s.set_attributes({k: v for k, v in attributes.items() if v is not None})


def inject(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` plus the current span's ``traceparent`` (a new dict when something is added)."""
    if _tracer is None:
        return headers
    from opentelemetry.propagate import inject as _inject

    out = dict(headers)
    _inject(out)
    return out


def traceparent() -> str | None:
    """The current span's W3C ``traceparent`` (None when off or no span is current)."""
    return inject({}).get("traceparent")


# ---- the engine's view of a request, from the API process ----------------------------------------
def _wall_ns(mono: float, now_mono: float, now_ns: int) -> int:
    """A ``time.monotonic()`` reading (this host's; the engine process shares the clock) as epoch ns."""
    return now_ns - int((now_mono - mono) * 1e9)


def engine_spans(
    arrival: float,
    scheduled: float,
    loaded: float,
    first_token: float,
    finished: float,
    attributes: dict[str, Any],
    transfer: dict[str, Any] | None = None,
) -> None:
    """Record one request's engine phases as children of the current span, from monotonic timestamps:
    ``engine.queue`` (arrival to first schedule), ``kv.transfer`` (first schedule to loaded, when
    ``transfer`` attributes are given), ``engine.prefill`` (to the first token), ``engine.decode``
    (to the end). ``loaded`` <= 0: no transfer."""
    if _tracer is None:
        return
    from opentelemetry import trace

    now_mono, now_ns = time.monotonic(), time.time_ns()

    def ns(t: float) -> int:
        return _wall_ns(t, now_mono, now_ns)

    parent = trace.get_current_span()
    if not parent.is_recording():
        return
    ctx = trace.set_span_in_context(parent)
    root = _tracer.start_span("engine", context=ctx, start_time=ns(arrival), attributes=attributes)
    inner = trace.set_span_in_context(root)
    phases: Iterable[tuple[str, float, float, dict[str, Any] | None]] = (
        ("engine.queue", arrival, scheduled, None),
        ("kv.transfer", scheduled, loaded, transfer),
        ("engine.prefill", loaded if loaded > 0 else scheduled, first_token, None),
        ("engine.decode", first_token, finished, None),
    )
    for name, t0, t1, attrs in phases:
        if name == "kv.transfer" and (transfer is None or loaded <= 0):
            continue
        if t0 <= 0 or t1 <= 0:
            continue
        _tracer.start_span(name, context=inner, start_time=ns(t0), attributes=attrs).end(end_time=ns(max(t1, t0)))
    root.end(end_time=ns(finished))


# ---- servers ----------------------------------------------------------------------------------------
def instrument(app: Any, paths: Iterable[str], name: str) -> None:
    """Give each request to ``paths`` on ``app`` (FastAPI/Starlette) a server span named
    ``"<name> <path>"``, child of the client's ``traceparent``; off: nothing is added."""
    if _tracer is None:
        return
    app.add_middleware(_TraceMiddleware, paths=frozenset(paths), name=name)


class _TraceMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware): the span covers a streamed body to its last byte, and the
    endpoint runs in the span's context (what `span`, `inject` and `engine_spans` hang off)."""

    def __init__(self, app: Any, paths: frozenset[str], name: str) -> None:
        self.app, self.paths, self.name = app, paths, name

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or _tracer is None:
            await self.app(scope, receive, send)
            return
        from opentelemetry import trace
        from opentelemetry.propagate import extract

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        with _tracer.start_as_current_span(
            f"{self.name} {scope['path']}",
            context=extract(carrier),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": scope.get("method", ""), "url.path": scope["path"]},
        ) as s:

            async def sending(message: dict) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    s.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        s.set_status(trace.Status(trace.StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, sending)
