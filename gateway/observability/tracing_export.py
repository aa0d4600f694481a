"""The export side of tracing: sampler, tracer provider, OTLP exporter and its bounded queue.

Imported only when tracing is on (`--otlp-endpoint`, through gateway/observability/tracing.py). Spans leave
the event loop through the SDK's `BatchSpanProcessor`: ending a span appends it to a deque of
at most `QUEUE_SIZE` (no lock, no I/O), and the processor's own thread encodes and sends
batches. So export never blocks the loop, and memory stays bounded whatever the collector
does: when the queue is full the SDK drops the oldest span (and logs so, at most once per
20 s). Dropped spans are counted in `gateway_trace_spans_dropped_total{reason}`: "queue_full"
(reported by the processor itself, `DropMetrics`) and "export_failed" (a batch the collector
refused or never took, after the exporter's own retries, counted by `CountingExporter`).

The exporters read the standard `OTEL_EXPORTER_OTLP_*` variables for what the flags do not
cover (headers such as an API key, TLS client certificates, compression).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

QUEUE_SIZE = 2048  # spans waiting for export (the SDK's default; a few MB at most)
BATCH_SIZE = 512  # spans per export request
DELAY_MS = 1000  # longest a span waits before its batch is sent
EXPORT_TIMEOUT = 10.0  # seconds one export may take, retries included
STOP_TIMEOUT_MS = 5000  # what is still queued at shutdown gets this long to leave

log = logging.getLogger("gateway.observability.tracing")


def exporter_class(protocol: str) -> type[SpanExporter]:
    """The OTLP exporter of `protocol`; raises ImportError when its package is missing."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
    return OTLPSpanExporter


def traces_url(endpoint: str, protocol: str) -> str:
    """OTLP/HTTP posts to a full URL; a bare collector address gets the standard path."""
    if protocol == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


class CountingExporter(SpanExporter):
    """The real exporter, counting the spans of every batch that did not make it."""

    def __init__(self, inner: SpanExporter, dropped) -> None:
        self.inner = inner
        self.dropped = dropped  # a prometheus Counter child

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # the processor logs it; the spans are lost all the same
            self.dropped.inc(len(spans))
            raise
        if result is not SpanExportResult.SUCCESS:
            self.dropped.inc(len(spans))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class DropMetrics:
    """What the SDK's batch processor reports through its `ProcessorMetricsT` hook
    (`drop_items` for each span it drops: "queue_full", "already_shutdown"), counted in our
    Prometheus counter. The SDK fills that hook itself only when its own internal metrics
    are switched on by environment, so `Export.start` sets it (`attach`)."""

    def __init__(self, dropped) -> None:
        self.dropped = dropped  # the Counter; labelled by reason

    def register_queue_size(self, get_queue_size) -> None:
        pass

    def finish_items(self, count: int) -> None:
        pass

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        self.dropped.labels(error_type).inc(count)

    def attach(self, processor: BatchSpanProcessor) -> bool:
        """Count this processor's drops; False when this SDK version has no such hook (its
        own log line, at most one per 20 s, then says that spans are dropped)."""
        inner = getattr(processor, "_batch_processor", None)
        if inner is None or not hasattr(inner, "_metrics"):
            return False
        inner._metrics = self
        return True


class Export:
    """Owns the provider, processor and exporter of one serving process (start/stop)."""

    def __init__(self, endpoint: str, protocol: str, ratio: float, service: str,
                 version: str, metrics) -> None:
        self.exporter_class = exporter_class(protocol)  # fails now, at configuration time
        self.url = traces_url(endpoint, protocol)
        self.sampler = ParentBased(TraceIdRatioBased(ratio))
        self.resource = Resource.create({"service.name": service, "service.version": version})
        self.drops = DropMetrics(metrics.trace_spans_dropped)
        self.export_failed = metrics.trace_spans_dropped.labels("export_failed")
        self.processor: BatchSpanProcessor | None = None
        self.provider: TracerProvider | None = None

    def start(self) -> TracerProvider:
        """Build the pipeline (the processor starts its export thread)."""
        exporter = CountingExporter(
            self.exporter_class(endpoint=self.url, timeout=EXPORT_TIMEOUT), self.export_failed)
        self.processor = BatchSpanProcessor(
            exporter, max_queue_size=QUEUE_SIZE, schedule_delay_millis=DELAY_MS,
            max_export_batch_size=BATCH_SIZE, export_timeout_millis=EXPORT_TIMEOUT * 1000)
        if not self.drops.attach(self.processor):
            log.warning("this OpenTelemetry SDK does not report dropped spans to the gateway: "
                        "gateway_trace_spans_dropped_total counts export failures only")
        # no atexit hook: stop() is the one shutdown, bounded
        self.provider = TracerProvider(sampler=self.sampler, resource=self.resource,
                                       shutdown_on_exit=False)
        self.provider.add_span_processor(self.processor)
        return self.provider

    def stop(self) -> None:
        """Send what is queued (for at most STOP_TIMEOUT_MS), then stop the thread, which may
        still finish an export under way (EXPORT_TIMEOUT). Blocking: the caller runs it off
        the event loop."""
        if self.processor is not None:
            self.processor.force_flush(STOP_TIMEOUT_MS)
            self.processor.shutdown()
            self.processor = None
