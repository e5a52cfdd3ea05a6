"""Prometheus metrics of one parameter server, for ``ps-server --metrics-port``.

    ps-server --mode sync --num-workers 2 --metrics-port 9100     # --metrics-host defaults to --host
    curl -s http://127.0.0.1:9100/metrics | grep ^tfps_

    metrics = Metrics(core)                          # hooks the core's Stats observers
    add_to_server(servicer, grpc_server, traffic=metrics)   # counts bytes per method
    endpoint = metrics.bind("127.0.0.1", 0)          # ConfigError if it cannot; .port is the bound one
    endpoint.start(); ...; endpoint.stop()

Plain HTTP, no token and no TLS, whatever the gRPC side uses: the series say how
training goes, never what the parameters are. Each server has its own registry,
so several servers in one process (tests) do not mix. Most series are read from
``ParameterServer.status()`` at scrape time, so one scrape is one consistent
status and nothing is counted twice; only the events below are observed as they
happen. Counters start from what a restored checkpoint holds.

Read from the status at each scrape:

- ``tfps_rounds_completed_total``: updates applied to the parameters; sync: rounds
  completed; async and ssp: pushes applied (each is its own update);
- ``tfps_pushes_applied_total``, ``tfps_examples_applied_total``: pushes whose gradients
  were applied, and the examples (batch sizes) they were computed on;
- ``tfps_pushes_dropped_total``: pushes answered ``dropped``, nothing applied: sync with
  backup workers, late for a round that completed without them; async and ssp with
  ``--stale-gradient-policy drop``, staler than ``--max-staleness``;
- ``tfps_pushes_scaled_total``: policy scale, pushes applied with a reduced learning rate;
- ``tfps_pushes_replayed_total``: retries of a push already applied, answered from the record;
- ``tfps_rounds_timed_out_total``, ``tfps_rounds_aborted_total``: sync rounds discarded
  after ``--barrier-timeout``, or because a worker they needed died;
- ``tfps_push_staleness_versions`` (histogram): per applied push, the server version at
  apply minus the version its gradient was computed on (always 0 in sync);
- gauges ``tfps_version``, ``tfps_round`` (sync: the round being collected; ssp: the
  slowest worker's clock; async: 0), ``tfps_num_workers``, ``tfps_live_workers``
  (registered, neither dead nor finished), ``tfps_dead_workers``, ``tfps_finished_workers``,
  ``tfps_barrier_waiting_for_workers``, ``tfps_initialized``, ``tfps_parameters``,
  ``tfps_last_loss``, ``tfps_uptime_seconds``, ``tfps_max_ahead_steps`` (ssp only), and
  ``tfps_info`` (1, labels mode, stale_gradient_policy, dead_worker_policy, incarnation);
- ``tfps_checkpoint_age_seconds``, ``tfps_last_checkpoint_version``: the last checkpoint
  written or restored; absent while there is none;
- per worker (label ``worker``, its index): ``tfps_worker_wait_seconds`` and
  ``tfps_worker_work_seconds``, moving averages over its recent pushes of the time
  inside the server's push (the barrier or bound wait) and between its pushes (pull,
  compute, upload), as in ``ps-status``; ``tfps_worker_pushes_total``,
  ``tfps_worker_dropped_total``, ``tfps_worker_last_step``,
  ``tfps_worker_last_seen_age_seconds``, ``tfps_worker_alive`` (1, or 0 once dead or finished).

Observed as they happen (through ``Stats.on_push``/``on_apply`` and ``add_to_server``):

- ``tfps_push_wait_seconds`` (histogram): per answered push, the seconds it spent in
  the consistency mode: the apply, and in sync or ssp the wait for the others;
- ``tfps_apply_seconds`` (histogram): per update, the seconds of the update alone:
  sync, averaging the round's gradients and one optimizer step; async and ssp, one
  push's optimizer step;
- ``tfps_received_bytes_total``, ``tfps_sent_bytes_total`` (label ``method``): request and
  response message bytes of the gRPC service (gRPC framing, headers and TLS not counted;
  pushes and pulls through shared memory carry only their small headers).

Besides these, the registry holds the client library's standard ``process_*`` and
``python_*`` series.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, make_wsgi_app)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ps_server.core.parameter_server import ParameterServer
from ps_common.settings import ConfigError

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # and +Inf
PUSH_WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
APPLY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    """The registry of one server: the status collector, the event histograms and the byte counters."""

    def __init__(self, core: ParameterServer):
        self.registry = CollectorRegistry()
        for standard in (ProcessCollector, PlatformCollector, GCCollector):
            standard(registry=self.registry)
        self.registry.register(StatusCollector(core))
        self.push_wait = Histogram(
            "tfps_push_wait_seconds", "Seconds each answered push spent in the consistency mode: the apply, "
            "and in sync or ssp the wait for the other workers", buckets=PUSH_WAIT_BUCKETS, registry=self.registry)
        self.apply = Histogram(
            "tfps_apply_seconds", "Seconds of each update alone: sync, averaging a round's gradients and one "
            "optimizer step; async and ssp, one push's optimizer step", buckets=APPLY_BUCKETS, registry=self.registry)
        self._received = Counter("tfps_received_bytes", "Request message bytes received by the gRPC service "
                                 "(framing and TLS not counted)", ["method"], registry=self.registry)
        self._sent = Counter("tfps_sent_bytes", "Response message bytes sent by the gRPC service "
                             "(framing and TLS not counted)", ["method"], registry=self.registry)
        core.stats.on_push = self.push_wait.observe
        core.stats.on_apply = self.apply.observe

    def received(self, method: str):
        """``count(nbytes)`` for requests of ``method``. ``service.add_to_server`` asks for
        every method at registration, so each series exists, at 0, from the first scrape."""
        return self._received.labels(method=method).inc

    def sent(self, method: str):
        """``count(nbytes)`` for responses of ``method``."""
        return self._sent.labels(method=method).inc

    def bind(self, host: str, port: int) -> "MetricsEndpoint":
        """Bind ``host:port`` (0: a free port) now, to serve from ``start()``; ConfigError if it cannot."""
        return MetricsEndpoint(self.registry, host, port)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # one line per scrape would drown the server's log
        pass


class MetricsEndpoint:
    """``GET /metrics`` over plain HTTP, one thread per request; bound at construction."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        host = host.strip("[]")  # "[::1]" as gRPC writes it
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
            server_class = type("MetricsHTTPServer", (socketserver.ThreadingMixIn, WSGIServer),
                                {"daemon_threads": True, "address_family": family})
            self._httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class,
                                      handler_class=_QuietHandler)
        except OSError as e:
            raise ConfigError(f"cannot serve metrics on {host}:{port} (--metrics-host/--metrics-port): "
                              f"{e.strerror or e}") from None
        self.host, self.port = self._httpd.server_address[:2]  # as bound: the port 0 picked, say
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> "MetricsEndpoint":
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="ps-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering and close the socket (safe to call twice, or before start)."""
        if self._thread is not None:
            self._httpd.shutdown()  # returns once serve_forever has; only valid while it runs
            self._thread.join(timeout=5.0)
            self._thread = None
        self._httpd.server_close()


class StatusCollector:
    """Every series that ``ParameterServer.status()`` already holds, read at scrape time."""

    def __init__(self, core: ParameterServer):
        self.core = core

    def collect(self):
        core = self.core
        s = core.status()
        now = time.monotonic()  # the clock of WorkerRecord.last_seen in a server

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        yield counter("tfps_rounds_completed", "Updates applied to the parameters: sync, rounds completed; "
                      "async and ssp, pushes applied", s.round if s.mode == "sync" else s.pushes_applied)
        yield counter("tfps_pushes_applied", "Pushes whose gradients were applied", s.pushes_applied)
        yield counter("tfps_examples_applied", "Examples (batch sizes) of the applied pushes", s.examples_applied)
        yield counter("tfps_pushes_dropped", "Pushes answered dropped, nothing applied: sync backup workers' late "
                      "pushes; async/ssp pushes staler than --max-staleness (policy drop)", s.pushes_dropped)
        yield counter("tfps_pushes_scaled", "Pushes applied with a learning rate scaled down for staleness "
                      "(policy scale)", s.pushes_scaled)
        yield counter("tfps_pushes_replayed", "Retried pushes answered from the record, not applied again",
                      s.pushes_replayed)
        yield counter("tfps_rounds_timed_out", "Sync rounds discarded after --barrier-timeout", s.rounds_timed_out)
        yield counter("tfps_rounds_aborted", "Sync rounds discarded because a worker they needed died",
                      s.rounds_aborted)

        yield _staleness_histogram(core.stats.staleness_histogram())

        info = GaugeMetricFamily("tfps_info", "This server: 1, with its settings as labels",
                                 labels=["mode", "stale_gradient_policy", "dead_worker_policy", "incarnation"])
        info.add_metric([s.mode, s.stale_gradient_policy, s.dead_worker_policy, s.incarnation], 1)
        yield info
        alive = [w for w in s.workers if not w.dead and not w.left]
        yield gauge("tfps_initialized", "1 once the variables are initialized", int(s.initialized))
        yield gauge("tfps_version", "Version of the parameters: updates applied", s.version)
        yield gauge("tfps_round", "Sync: the round being collected; ssp: the slowest worker's clock; async: 0",
                    s.round)
        yield gauge("tfps_num_workers", "Workers the server was started for (--num-workers)", s.num_workers)
        yield gauge("tfps_live_workers", "Registered workers neither declared dead nor finished", len(alive))
        yield gauge("tfps_dead_workers", "Workers declared dead (lease expired) and not registered again",
                    sum(1 for w in s.workers if w.dead and not w.left))
        yield gauge("tfps_finished_workers", "Workers that finished (left)", sum(1 for w in s.workers if w.left))
        yield gauge("tfps_barrier_waiting_for_workers", "Workers the current sync round (or the ssp bound) "
                    "still waits for", len(s.waiting_for))
        yield gauge("tfps_parameters", "Scalars in the variables", s.num_parameters)
        yield gauge("tfps_last_loss", "Loss of the last applied push or round (NaN before any)", s.last_loss)
        yield gauge("tfps_uptime_seconds", "Seconds since the server started", s.uptime_s)
        if s.mode == "ssp":
            yield gauge("tfps_max_ahead_steps", "The most steps an applied push was ahead of the slowest worker",
                        s.max_ahead)
        if s.last_checkpoint_version >= 0:  # absent while there is none
            yield gauge("tfps_checkpoint_age_seconds", "Seconds since the last checkpoint was written or restored",
                        s.checkpoint_age_s)
            yield gauge("tfps_last_checkpoint_version", "Version of the last checkpoint written or restored",
                        s.last_checkpoint_version)

        per_worker = [
            (GaugeMetricFamily, "tfps_worker_wait_seconds", "Moving average of the seconds the worker's pushes spent "
             "inside the server: the apply, and the barrier or bound wait", lambda w: w.wait_s),
            (GaugeMetricFamily, "tfps_worker_work_seconds", "Moving average of the seconds between the worker's "
             "pushes: its pull, compute and upload", lambda w: w.work_s),
            (CounterMetricFamily, "tfps_worker_pushes", "Pushes answered to the worker", lambda w: w.pushes),
            (CounterMetricFamily, "tfps_worker_dropped", "The worker's pushes answered dropped", lambda w: w.dropped),
            (GaugeMetricFamily, "tfps_worker_last_step", "The worker's last pushed step (-1: none)",
             lambda w: w.last_step),
            (GaugeMetricFamily, "tfps_worker_last_seen_age_seconds", "Seconds since the worker's last call or "
             "heartbeat", lambda w: max(0.0, now - w.last_seen)),
            (GaugeMetricFamily, "tfps_worker_alive", "1 while the worker is registered, not dead and not finished",
             lambda w: int(not w.dead and not w.left)),
        ]
        for kind, name, doc, value in per_worker:
            family = kind(name, doc, labels=["worker"])
            for w in s.workers:
                family.add_metric([str(w.worker_id)], value(w))
            yield family


def _staleness_histogram(counts: dict[int, int]) -> HistogramMetricFamily:
    """Cumulative buckets of the core's exact staleness counts (``Stats.staleness_counts``)."""
    buckets = [(str(float(le)), sum(c for s, c in counts.items() if s <= le)) for le in STALENESS_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily(
        "tfps_push_staleness_versions", "Per applied push, the server version at apply minus the version its "
        "gradient was computed on (sync: 0)", buckets=buckets, sum_value=sum(s * c for s, c in counts.items()))
