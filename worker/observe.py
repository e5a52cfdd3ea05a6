"""What a worker shows of its training: a progress bar or log lines, TensorBoard, Prometheus.

    obs = Observer(worker_index=0, total_steps=400, log_every=10, progress="auto",
                   logdir="runs/a", metrics_port=9100)
    obs.set_index(reg.worker_id)    # once known (--worker-index auto)
    obs.step(record)                # after every step: one ``history`` record of worker.trainer
    obs.evaluation(record)          # the chief's --eval-every records
    obs.end_progress()              # training is over: the bar's line ends (before the evaluation)
    obs.finish(result)              # the final result dict; ends the bar's line
    obs.close()                     # idempotent; also ends the bar's line if finish was not reached

What each shows, and the metric and summary names: docs/observing.md. Flags
(``worker.config``): ``--progress {auto,bar,lines,off}``, ``--logdir``, ``--metrics-port``,
``--metrics-host``; ``auto`` is ``bar`` when ``stream`` is a terminal, else ``lines``.

The bar is redrawn at most every ``refresh_s`` seconds (and always for the last step), cut
to the terminal's width so it never wraps; a log record headed for a terminal first clears
it (``_clear_bar_line``), so the record starts at column 0. ``lines``: every ``log_every``
steps and at the last one, an INFO record in the format tests and scripts grep for.

TensorBoard (TensorFlow is imported only with a logdir): scalars at x = the number of
steps done (``record["step"] + 1``), flushed every ``TB_FLUSH_STEPS`` steps, at least every
10 s, and by ``finish``/``close``. Prometheus (a metrics port of None or negative: no
exporter; 0: any free port, see ``metrics_port``): a registry of this observer's own,
labelled ``worker="<index>"``; a port that cannot be bound raises ``ConfigError``.

A step's time is ``pull_s + compute_s + push_s + knob_s``, without evaluations, snapshots
or reconnections between steps. "Recent" throughput (bar, gauge, TensorBoard) is examples
over the wall time (``t``) of the steps in about the last ``RATE_WINDOW_S`` seconds; the
bar's ETA uses the same window's steps per second.

Thread safety: call ``step``/``evaluation``/``finish`` from one thread (the training loop);
the exporter serves scrapes from its own thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import threading
import time

from ps_common.settings import ConfigError

log = logging.getLogger("worker")

PROGRESS_MODES = ("auto", "bar", "lines", "off")
RATE_WINDOW_S = 10.0  # "recent" throughput: about the last 10 s of steps
TB_FLUSH_STEPS = 20
BAR_WIDTH = 30  # Keras' default
# Seconds; a pull or push on loopback can take under a millisecond, a sync barrier wait a minute.
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, float("inf"))


class Observer(contextlib.AbstractContextManager):
    """Shows one worker's training as a bar or log lines, in TensorBoard and to Prometheus."""

    def __init__(self, worker_index: int = 0, total_steps: int = 0, log_every: int = 10, progress: str = "auto",
                 logdir: str = "", metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 stream=None, refresh_s: float = 0.1):
        if progress not in PROGRESS_MODES:
            raise ConfigError(f"--progress must be one of {', '.join(PROGRESS_MODES)}, got {progress!r}")
        self.worker_index = worker_index
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.logdir = logdir
        self.stream = sys.stderr if stream is None else stream
        self.refresh_s = refresh_s
        self.progress = ("bar" if _isatty(self.stream) else "lines") if progress == "auto" else progress
        self._rate = _RecentRate(RATE_WINDOW_S)
        self._last: dict | None = None  # the newest step record
        # lines: what the next line's examples/s covers
        self._line_examples, self._line_t = 0, 0.0
        # bar: what is on screen
        self._bar_len = 0  # characters of the bar on the current line; 0: none
        self._bar_drawn_at = float("-inf")  # time.monotonic() of the last draw
        self._bar_stale = False  # the newest record is not drawn yet
        try:
            self._bar_columns = os.get_terminal_size(self.stream.fileno()).columns or 80
        except (AttributeError, ValueError, OSError):  # not a real terminal (a test's fake one)
            self._bar_columns = 80
        self._bar_lock = threading.Lock()  # the bar's writes against other threads' log records clearing it
        self._hooked: list[logging.Handler] = []
        self._tb = self._tb_scalar = None  # the summary writer, created at the first write (the index is known by then)
        self._tb_steps = 0
        self._closed = False
        self._metrics = None
        self._httpd = self._http_thread = None
        self.metrics_port = 0
        if metrics_port is not None and metrics_port >= 0:
            self._start_exporter(metrics_port, metrics_host)

    def __exit__(self, *exc) -> None:
        self.close()

    # The training loop's calls.

    def set_index(self, index: int) -> None:
        """The worker's index, when the server assigned it after this observer was made."""
        if index != self.worker_index and self._metrics is not None:
            self._metrics.relabel(str(self.worker_index), str(index))
        self.worker_index = index

    def step(self, record: dict) -> None:
        """One step's history record (worker.trainer): shows it, writes it, counts it."""
        self._last = record
        self._rate.add(record["t"], record["batch_size"])
        step_s = record["pull_s"] + record["compute_s"] + record["push_s"] + record.get("knob_s", 0.0)
        examples_per_s, _ = self._rate.per_s()
        if self._metrics is not None:
            self._metrics.observe(str(self.worker_index), record, step_s, examples_per_s)
        if self.logdir:
            self._scalars(record["step"] + 1, {
                "train/loss": record["loss"], "train/staleness": record["staleness"], "time/step_s": step_s,
                "time/pull_s": record["pull_s"], "time/compute_s": record["compute_s"], "time/push_s": record["push_s"],
                "throughput/examples_per_s": examples_per_s})
            self._tb_steps += 1
            if self._tb_steps % TB_FLUSH_STEPS == 0:
                self._tb.flush()
        if self.progress == "lines":
            self._log_line(record)
        elif self.progress == "bar":
            self._bar_stale = True
            if record["step"] + 1 >= self.total_steps or time.monotonic() - self._bar_drawn_at >= self.refresh_s:
                self._draw_bar()

    def evaluation(self, record: dict) -> None:
        """The chief's --eval-every record: step, t, version, test_accuracy, test_loss, eval_s."""
        if self.logdir:
            self._scalars(record["step"] + 1, {"eval/test_accuracy": record["test_accuracy"],
                                               "eval/test_loss": record["test_loss"]})

    def end_progress(self) -> None:
        """The last step is done: draws the bar's last state and ends its line, so what is
        printed next (the chief's evaluation) starts on a line of its own. Idempotent."""
        if self.progress == "bar" and self._bar_stale:
            self._draw_bar()
        self._end_bar_line()

    def finish(self, result: dict) -> None:
        """The end of training: ends the bar's line (``end_progress``); writes final/*."""
        self.end_progress()
        if self.logdir:
            finals = {f"final/{k}": result[k] for k in ("test_accuracy", "test_loss") if result.get(k) is not None}
            if finals:
                self._scalars(result.get("steps") or self.total_steps, finals)
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        """Ends the bar's line, flushes and closes TensorBoard, stops the exporter. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._end_bar_line()
        for handler in self._hooked:
            handler.removeFilter(self._clear_bar_line)
        self._hooked.clear()
        if self._tb is not None:
            self._tb.close()  # flushes first
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._http_thread.join(timeout=5.0)

    # Log lines.

    def _log_line(self, record: dict) -> None:
        done = record["step"] + 1
        self._line_examples += record["batch_size"]
        if done % self.log_every and done != self.total_steps:
            return
        rate = self._line_examples / max(record["t"] - self._line_t, 1e-9)
        log.info("step %d/%d loss %.4f examples/s %.0f version %d staleness %d%s", done, self.total_steps,
                 record["loss"], rate, record["version"], record["staleness"],
                 " (gradient dropped: round finished without it)" if record.get("dropped") else "")
        self._line_examples, self._line_t = 0, record["t"]

    # The bar.

    def _bar_text(self, record: dict) -> str:
        done, total = record["step"] + 1, max(self.total_steps, 1)
        examples_per_s, steps_per_s = self._rate.per_s()
        if done >= total:
            when = f"took {_duration(record['t'])}"
        else:
            when = f"ETA {_duration((total - done) / steps_per_s)}" if steps_per_s > 0 else "ETA ?"
        head = f"step {done}/{self.total_steps} "
        tail = (f" {min(100, 100 * done // total):3d}% loss {record['loss']:.4f} "
                f"{examples_per_s:.0f} ex/s staleness {record['staleness']} {when}")
        room = self._bar_columns - 1 - len(head) - len(tail) - 2  # the last column would wrap on some terminals
        width = max(10, min(BAR_WIDTH, room))
        filled = min(width, width * done // total)
        bar = "=" * filled if done >= total else "=" * max(filled - 1, 0) + ">" + "." * (width - max(filled, 1))
        return f"{head}[{bar}]{tail}"[: self._bar_columns - 1]

    def _draw_bar(self) -> None:
        # A terminal's log handlers clear the bar first; checked at every draw, not once: logging may be
        # configured after this observer was made.
        for logger in (logging.getLogger(), log):
            for handler in logger.handlers:
                stream = getattr(handler, "stream", None)
                if handler not in self._hooked and stream is not None and (stream is self.stream or _isatty(stream)):
                    handler.addFilter(self._clear_bar_line)
                    self._hooked.append(handler)
        text = self._bar_text(self._last)
        with self._bar_lock:
            # Pad over a longer previous line instead of an ANSI erase: plain "\r" works everywhere.
            self.stream.write("\r" + text + " " * max(0, self._bar_len - len(text)))
            self.stream.flush()
            self._bar_len = len(text)
        self._bar_drawn_at = time.monotonic()
        self._bar_stale = False

    def _clear_bar_line(self, record: logging.LogRecord) -> bool:
        """A terminal's log handler's filter: clears the bar's line before the record is written."""
        self._end_bar_line(clear=True)
        return True

    def _end_bar_line(self, clear: bool = False) -> None:
        """Ends the bar's line; ``clear`` (before a log record is written to the terminal):
        empties it instead, and the next step draws it again."""
        with self._bar_lock:
            if self._bar_len:
                self.stream.write("\r" + " " * self._bar_len + "\r" if clear else "\n")
                self.stream.flush()
                self._bar_len = 0
                if clear:
                    self._bar_drawn_at = float("-inf")

    # TensorBoard.

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        """What ``tf.summary.scalar`` writes, without it: tensorflow-cpu does not bring the
        ``tensorboard`` package that implements it, ``tf.summary.write`` is TensorFlow's own."""
        import tensorflow as tf  # only with a logdir: a worker without one does not pay for it here

        if self._tb is None:
            # max_queue is large so that flushes happen when we say, not every couple of steps.
            self._tb = tf.summary.create_file_writer(os.path.join(self.logdir, f"worker{self.worker_index}"),
                                                     max_queue=1000, flush_millis=10_000)
            self._tb_scalar = tf.compat.v1.SummaryMetadata(
                plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"),
                data_class="DATA_CLASS_SCALAR")  # as the scalars dashboard expects
        with self._tb.as_default():
            for tag, value in values.items():
                tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=self._tb_scalar)

    # Prometheus.

    def _start_exporter(self, port: int, host: str) -> None:
        try:
            from prometheus_client import start_http_server
        except ImportError:
            raise ConfigError("--metrics-port needs the prometheus_client package "
                              "(pip install prometheus-client)") from None
        self._metrics = _WorkerMetrics(str(self.worker_index) if self.worker_index >= 0 else None)
        try:
            self._httpd, self._http_thread = start_http_server(port, addr=host, registry=self._metrics.registry)
        except OSError as e:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} "
                              f"({e.strerror or e})") from None
        self.metrics_port = self._httpd.server_port
        log.info("Prometheus metrics at http://%s:%d/metrics", host, self.metrics_port)


class _WorkerMetrics:
    """The exporter's series, in a registry of their own (several observers may live in one process)."""

    def __init__(self, label: str | None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r, w = self.registry, ("worker",)
        self.seconds = {k: Histogram(f"tfps_worker_{k}_seconds", doc, w, registry=r, buckets=TIME_BUCKETS)
                        for k, doc in _SECONDS.items()}
        self.rate = Gauge("tfps_worker_examples_per_second", f"Examples per second over about the last "
                          f"{RATE_WINDOW_S:g} s of steps", w, registry=r)
        self.steps = Counter("tfps_worker_steps_total", "Steps finished", w, registry=r)
        self.examples = Counter("tfps_worker_examples_total", "Examples in the finished steps", w, registry=r)
        self.gauges = {k: Gauge(f"tfps_worker_{k}", doc, w, registry=r) for k, doc in _GAUGES.items()}
        self.all = (*self.seconds.values(), self.rate, self.steps, self.examples, *self.gauges.values())
        if label is not None:  # a known index: its series read 0 before the first step
            for metric in self.all:
                metric.labels(worker=label)

    def relabel(self, old: str, new: str) -> None:
        for metric in self.all:
            with contextlib.suppress(KeyError):  # no series of the old index yet
                metric.remove(old)
            metric.labels(worker=new)

    def observe(self, label: str, record: dict, step_s: float, examples_per_s: float) -> None:
        for k, histogram in self.seconds.items():
            histogram.labels(worker=label).observe(step_s if k == "step" else record[f"{k}_s"])
        self.rate.labels(worker=label).set(examples_per_s)
        self.steps.labels(worker=label).inc()
        self.examples.labels(worker=label).inc(record["batch_size"])
        for k, gauge in self.gauges.items():
            gauge.labels(worker=label).set(record["step"] + 1 if k == "last_step" else record[k])


# The exporter's histograms (tfps_worker_<key>_seconds) and last-record gauges (tfps_worker_<key>).
_SECONDS = {"step": "Wall time of a step: pull + compute + push + experiment-knob sleeps",
            "pull": "Pull of the parameters and loading them into the model",
            "compute": "Loss and gradients with tf.GradientTape",
            "push": "Push of the gradients, with any barrier or staleness wait"}
_GAUGES = {"staleness": "Staleness of the last push", "loss": "Loss of the last step",
           "last_step": "The last step finished, counted from 1 (as in 'step N/M')"}


class _RecentRate:
    """Examples and steps per second over the steps of about the last ``window_s`` seconds of ``t``."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=1000)

    def add(self, t: float, examples: int) -> None:
        self._steps.append((t, examples))
        # Keep the newest window plus the step before it, whose end is where the window's time starts.
        while len(self._steps) > 2 and t - self._steps[1][0] >= self.window_s:
            self._steps.popleft()

    def per_s(self) -> tuple[float, float]:
        """(examples, steps) per second of the window (called after ``add``: it holds a step)."""
        if len(self._steps) == 1:  # the first step since training started at t = 0
            (seconds, examples), steps = self._steps[0], 1
        else:
            seconds = self._steps[-1][0] - self._steps[0][0]
            examples, steps = sum(n for _, n in list(self._steps)[1:]), len(self._steps) - 1
        return (examples / seconds, steps / seconds) if seconds > 0 else (0.0, 0.0)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def _duration(seconds: float) -> str:
    """Keras' ETA format: 12s, 3:07, 1:02:03."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    if s >= 60:
        return f"{s // 60}:{s % 60:02d}"
    return f"{s}s"


__all__ = ["Observer", "PROGRESS_MODES"]
