"""Worker faults with real processes: killed, paused, slow, or cut off from the server.

    pytest -q tests/chaos/test_worker_faults.py

Each test starts a ps-server and ps-workers on 127.0.0.1 (synthetic data, the
MLP, a lease of a few seconds, heartbeats every 0.3 s), injects one fault and
checks the outcome the dead-worker policy promises (``ps_server.core.modes.sync_mode``):

- ``abort``: "ends the round at once with WorkerDead for every waiter";
- ``wait``: "keeps the round open until a replacement registers with that index";
- ``shrink``: "stops expecting the dead worker and finishes rounds with the live
  ones ... (a worker that registers again is expected again)";
- backup workers: a round completes with the first ``replicas_to_aggregate``
  pushes; a push for a completed round it was not part of "is answered
  ``dropped`` and counted".

A worker is cut off by ``CuttableProxy``, a TCP proxy the test puts between it
and the server. The barrier timeout is large (120 s) everywhere, so an outcome
that arrives within a few seconds is the lease and the policy at work, not a
barrier timing out.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time

import pytest

from tests.cluster.conftest import read_log, wait_exit
from worker.client import PSClient

pytestmark = [pytest.mark.chaos, pytest.mark.cluster]

LEASE = 2.0
BARRIER = 120.0
STARTUP = 180.0  # TensorFlow's import takes ~4 s per worker, much longer on a loaded machine
TRAINING = ("--dataset", "synthetic", "--model", "mlp", "--heartbeat-interval", "0.3", "--log-every", "10")


# -- helpers ---------------------------------------------------------------------------
def start_server(procs, policy: str, num_workers: int = 2, lease: float = LEASE, extra: tuple[str, ...] = ()):
    return procs.server("sync", num_workers, barrier_timeout=BARRIER,
                        extra=("--lease-timeout", str(lease), "--dead-worker-policy", policy, *extra))


def start_worker(procs, address: str, index: int, steps: int, num_workers: int = 2, *flags: str,
                 log_name: str = ""):
    return procs.start(
        [sys.executable, "-m", "worker", "--ps", address, "--worker-index", str(index),
         "--num-workers", str(num_workers), "--steps", str(steps), *TRAINING, *flags],
        log_name or f"worker{index}",
    )


def logs(*ps) -> str:
    return "\n".join(f"--- {p.log_path.name}:\n{read_log(p)[-2500:]}" for p in ps)


def wait_for(condition, timeout: float, what: str, running=()):
    """Poll ``condition`` until it holds; fail after ``timeout`` s or if a process in
    ``running`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        for p in running:
            assert p.poll() is None, \
                f"{p.log_path.name} exited ({p.returncode}) while waiting for {what}\n" + logs(*running)
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s\n" + logs(*running)
        time.sleep(0.05)


def worker_record(status, worker_id: int):
    return next(w for w in status.workers if w.worker_id == worker_id)


def is_dead(client: PSClient, worker_id: int) -> bool:
    s = client.status()
    return any(w.worker_id == worker_id and w.dead for w in s.workers)


def assert_finished_cleanly(proc, timeout: float = STARTUP, others=()):
    code = wait_exit(proc, timeout)
    log = read_log(proc)
    assert code == 0, logs(proc, *others)
    assert "Traceback" not in log and "ps-worker: error" not in log, log[-3000:]


class CuttableProxy:
    """127.0.0.1:<port> forwarding TCP to ``target``, under the test's control.

    ``cut()`` shuts down every open connection (the worker's in-flight calls fail
    with UNAVAILABLE) and answers new ones with a reset until ``restore()``; ``refused``
    counts those resets.
    ``close()`` stops every thread. Threads: one accepting, two per connection.
    """

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)  # so the accept loop sees close()
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()  # guards _open, _pairs; never held across a blocking call
        self._open = True
        self._pairs: list[list] = []  # [client, upstream, pumps finished]
        self._stopping = threading.Event()
        self._pumps: list[threading.Thread] = []  # appended by the accept thread only
        self.connections = 0
        self.refused = 0  # connections reset while cut
        self._acceptor = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        self._acceptor.start()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name="proxy-pump", daemon=True)
        t.start()
        self._pumps.append(t)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                refuse = not self._open
                self.refused += refuse
            if refuse:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=2.0)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            pair = [client, upstream, 0]
            with self._lock:
                if not self._open:  # cut while we connected
                    refuse = True
                    self.refused += 1
                else:
                    self._pairs.append(pair)
                    self.connections += 1
            if refuse:
                _reset(client)
                _reset(upstream)
                continue
            self._spawn(self._pump, client, upstream, pair)
            self._spawn(self._pump, upstream, client, pair)

    def _pump(self, src: socket.socket, dst: socket.socket, pair: list) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):  # wakes the other direction's pump
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            pair[2] += 1
            last = pair[2] == 2
            if last:
                self._pairs.remove(pair)
        if last:  # both pumps are out of recv/sendall: closing cannot hit a reused descriptor
            pair[0].close()
            pair[1].close()

    def cut(self) -> int:
        """Drop every connection and refuse new ones; returns how many were dropped."""
        with self._lock:
            self._open = False
            pairs = list(self._pairs)
            for client, upstream, _ in pairs:  # shutdown only: the pumps close
                for s in (client, upstream):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        return len(pairs)

    def restore(self) -> None:
        with self._lock:
            self._open = True

    def close(self) -> None:
        self._stopping.set()
        self._acceptor.join(timeout=5.0)  # no new pumps after this
        self._listener.close()
        self.cut()
        for t in self._pumps:
            t.join(timeout=5.0)
        alive = [t.name for t in [self._acceptor, *self._pumps] if t.is_alive()]
        assert not alive, f"proxy thread(s) still running: {alive}"


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset: the peer sees the connection refused, not a clean end."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


def two_workers(procs, address: str, steps: int, address1: str = ""):
    w0 = start_worker(procs, address, 0, steps)
    w1 = start_worker(procs, address1 or address, 1, steps)
    return w0, w1


def wait_training(client: PSClient, version: int, running, timeout: float = STARTUP) -> int:
    wait_for(lambda: client.status().version >= version, timeout, f"training to reach version {version}", running)
    return client.status().version


def kill_mid_round(client: PSClient, victim, victim_id: int, timeout: float = 60.0) -> float:
    """SIGKILL ``victim`` while the current round holds the others' pushes and waits
    for its own; returns when. (Paused first, so it cannot push between our look
    at the round and the kill; each pause is far shorter than the lease.)"""
    deadline = time.monotonic() + timeout
    while True:
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(0.1)  # a push already on the wire lands before we look
        if list(client.status().waiting_for) == [victim_id]:
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=10)
            return time.monotonic()
        os.kill(victim.pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"never caught worker {victim_id} missing from a round\n" + logs(victim)
        time.sleep(0.05)


# -- a killed worker, once per dead-worker policy --------------------------------------
def test_abort_policy_fails_the_survivor_within_the_lease_naming_the_dead_worker(procs):
    """abort "ends the round at once with WorkerDead for every waiter": the survivor
    fails within the lease (not the 120 s barrier) with one line naming worker 1,
    and the server keeps serving."""
    server, address = start_server(procs, "abort")
    w0, w1 = two_workers(procs, address, steps=2000)
    with PSClient(address) as client:
        wait_training(client, 5, (w0, w1))
        killed_at = kill_mid_round(client, w1, 1)

        # Promptly: the worker reports the failure within the lease and a tick or two,
        # and has exited (TensorFlow's teardown included) long before the barrier timeout.
        wait_for(lambda: "ps-worker: error" in read_log(w0), LEASE + 30, "the survivor's error")
        failed_after = time.monotonic() - killed_at
        code = wait_exit(w0, LEASE + 30)
        exited_after = time.monotonic() - killed_at
        log = read_log(w0)
        assert code == 1, log[-3000:]
        assert failed_after < LEASE + 5, f"the survivor took {failed_after:.1f} s to fail (lease {LEASE:g} s)"
        assert exited_after < BARRIER / 4, f"the survivor took {exited_after:.1f} s to exit"
        errors = [line for line in log.splitlines() if line.startswith("ps-worker: error")]
        assert len(errors) == 1, log[-3000:]
        assert "ABORTED" in errors[0] and "worker(s) 1 (" in errors[0] and "died" in errors[0], errors[0]
        assert "policy abort" in errors[0], errors[0]
        assert "Traceback" not in log

        # The server keeps serving, and says what happened.
        assert server.poll() is None
        assert client.health() == "SERVING"
        status = client.status()
        assert worker_record(status, 1).dead
        assert status.rounds_aborted >= 1
        assert status.rounds_timed_out == 0
        version, values = client.pull()
        assert version == status.version >= 5
        assert all(v.size for v in values.values())


@pytest.mark.recovery
def test_wait_policy_holds_the_round_until_a_replacement_takes_the_dead_workers_index(procs):
    """wait "keeps the round open until a replacement registers with that index":
    no round is lost, the run ends at exactly ``steps`` versions."""
    steps = 40
    server, address = start_server(procs, "wait", extra=("--replacement-timeout", "60"))
    w0, w1 = two_workers(procs, address, steps)
    with PSClient(address) as client:
        wait_training(client, 5, (w0, w1))
        kill_mid_round(client, w1, 1)

        # Declared dead, and the survivor's push waits for index 1 instead of failing.
        def held():
            s = client.status()
            return worker_record(s, 1).dead and list(s.waiting_for) == [1]
        wait_for(held, LEASE + 10, "worker 1 declared dead with the round waiting for it", (w0,))
        held_round = client.status().round

        replacement = start_worker(procs, address, 1, steps, log_name="worker1-replacement")
        assert_finished_cleanly(replacement, others=(w0,))
        assert_finished_cleanly(w0, others=(replacement,))
        assert f"registered as worker 1 of 2; server mode sync, version {held_round}, round {held_round}" \
            in read_log(replacement)

        status = client.status()
        assert status.version == steps  # every round completed exactly once
        assert status.rounds_aborted == 0 and status.rounds_timed_out == 0
        assert not worker_record(status, 1).dead
        assert server.poll() is None


@pytest.mark.recovery
def test_shrink_policy_lets_the_survivor_finish_every_step_alone(procs):
    """shrink "stops expecting the dead worker and finishes rounds with the live ones"."""
    steps = 60
    server, address = start_server(procs, "shrink")
    w0, w1 = two_workers(procs, address, steps)
    with PSClient(address) as client:
        wait_training(client, 5, (w0, w1))
        kill_mid_round(client, w1, 1)

        assert_finished_cleanly(w0, timeout=LEASE + 60)
        assert f"worker 0 finished {steps} steps" in read_log(w0)
        status = client.status()
        assert list(status.active_workers) == [0]
        assert worker_record(status, 1).dead
        assert status.version == steps
        assert status.rounds_aborted == 0 and status.rounds_timed_out == 0
        assert server.poll() is None


# -- a hang, not a death -----------------------------------------------------------------
@pytest.mark.recovery
def test_paused_worker_is_declared_dead_then_rejoins_when_resumed(procs):
    """SIGSTOP longer than the lease: the server cannot tell a hang from a death,
    so the worker is declared dead and the policy (shrink) applies. Resumed, the
    worker's next call is refused ("declared dead"), it registers again, is
    expected in rounds again, and finishes."""
    steps = 80
    server, address = start_server(procs, "shrink")
    w0, w1 = two_workers(procs, address, steps)
    with PSClient(address) as client:
        wait_training(client, 5, (w0, w1))
        os.kill(w1.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: list(client.status().active_workers) == [0] and is_dead(client, 1),
                     LEASE + 10, "the paused worker declared dead", (w0,))
            alone_from = client.status().version
            wait_training(client, alone_from + 3, (w0,))  # the survivor goes on alone
            assert client.status().version < steps, "the survivor finished before the paused worker resumed"
        finally:
            os.kill(w1.pid, signal.SIGCONT)

        assert_finished_cleanly(w1, others=(w0,))
        assert_finished_cleanly(w0, others=(w1,))
        log1 = read_log(w1)
        lost = [line for line in log1.splitlines() if "lost its place" in line]
        assert lost and "(declared-dead)" in lost[0], log1[-3000:]  # the reason; the text is withheld
        assert "worker 1 rejoined: resuming at step" in log1, log1[-3000:]

        status = client.status()
        assert not worker_record(status, 1).dead
        assert status.version == steps
        assert status.rounds_aborted == 0 and status.rounds_timed_out == 0
        assert server.poll() is None


# -- backup workers ----------------------------------------------------------------------
@pytest.mark.recovery
# over two shards: slow here; tests/cluster/test_shards.py runs backup workers over two shards by default
@pytest.mark.parametrize("shards", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_backup_workers_complete_rounds_without_the_slow_one_and_drop_its_late_gradients(procs, shards):
    """With 3 workers and --replicas-to-aggregate 2, rounds go on while one worker is
    paused (shorter than the lease), and its push for a completed round "is answered
    ``dropped`` and counted". Over two shards, shard 0 picks each round's contributors and
    shard 1 steps with the same ones: the same counts on both."""
    steps = 60
    servers = [start_server(procs, "abort", num_workers=3, extra=("--replicas-to-aggregate", "2"))
               for _ in range(shards)]
    server, address = servers[0]
    ws = [start_worker(procs, ",".join(a for _, a in servers), i, steps, 3, "--log-every", "1") for i in range(3)]
    with PSClient(address) as client:
        wait_training(client, 5, ws)
        os.kill(ws[2].pid, signal.SIGSTOP)  # slow, not dead: shorter than the lease
        try:
            # Resume after a few rounds: within the 16 rounds the server remembers, so its push
            # is answered "dropped" (an older one is refused as late and the worker rejoins;
            # with the streamed data path the other two can run 16 rounds in well under a second).
            before = client.status().version
            wait_for(lambda: client.status().version >= before + 3, LEASE / 2,
                     "rounds completing without the paused worker", ws[:2])
            during = client.status().version
        finally:
            os.kill(ws[2].pid, signal.SIGCONT)
        assert before + 3 <= during < before + 16, f"({before} -> {during})"

        for w in ws:
            assert_finished_cleanly(w, others=ws)
        status = client.status()
        assert status.version == steps
        assert status.pushes_dropped > 0
        assert worker_record(status, 2).dropped > 0
        assert not any(w.dead for w in status.workers)
        assert "(gradient dropped: round finished without it)" in read_log(ws[2]), read_log(ws[2])[-3000:]
        assert server.poll() is None
    for _, other in servers[1:]:
        with PSClient(other) as client:
            them = client.status()
        assert (them.version, them.pushes_applied, them.examples_applied) == \
            (status.version, status.pushes_applied, status.examples_applied)
        assert [w.pushes for w in them.workers] == [w.pushes for w in status.workers]


# -- a cut connection ----------------------------------------------------------------------
@pytest.mark.recovery
def test_connection_cut_shorter_than_the_lease_is_ridden_out_without_losing_a_round(procs):
    """The worker's calls fail with UNAVAILABLE; it reconnects and registers again
    before its lease runs out. Policy abort and a lease (3 s) well above the cut
    (0.5 s plus gRPC's ~1 s reconnect backoff): a death would fail the run."""
    steps, lease = 80, 3.0
    server, address = start_server(procs, "abort", lease=lease)
    proxy = CuttableProxy(address)
    try:
        w0, w1 = two_workers(procs, address, steps, address1=proxy.address)
        with PSClient(address) as client:
            wait_training(client, 5, (w0, w1))
            assert proxy.cut() >= 1
            time.sleep(0.5)
            proxy.restore()

            assert_finished_cleanly(w0, others=(w1,))
            assert_finished_cleanly(w1, others=(w0,))
            status = client.status()
            assert status.version == steps
            assert status.rounds_aborted == 0 and status.rounds_timed_out == 0
            assert not any(w.dead for w in status.workers)
            assert "declared dead" not in read_log(server)
            assert server.poll() is None
    finally:
        proxy.close()


@pytest.mark.recovery
@pytest.mark.slow  # ~25 s; declared dead and rejoined: the paused worker above, and a host cut in tests/hosts
def test_connection_cut_longer_than_the_lease_gets_the_worker_declared_dead_and_it_rejoins(procs):
    """A cut-off worker looks dead to the server: shrink goes on without it; once the
    connection is back, its reconnect loop registers it again ("a worker that
    registers again is expected again") and it finishes."""
    steps = 150
    server, address = start_server(procs, "shrink")
    proxy = CuttableProxy(address)
    try:
        w0, w1 = two_workers(procs, address, steps, address1=proxy.address)
        with PSClient(address) as client:
            wait_training(client, 5, (w0, w1))
            assert proxy.cut() >= 1
            try:
                wait_for(lambda: list(client.status().active_workers) == [0] and is_dead(client, 1),
                         LEASE + 10, "the cut-off worker declared dead", (w0, w1))
                alone_from = client.status().version
                wait_training(client, alone_from + 3, (w0,))  # the survivor goes on alone
            finally:
                proxy.restore()

            assert_finished_cleanly(w1, others=(w0,))
            assert_finished_cleanly(w0, others=(w1,))
            assert "worker 1 rejoined: resuming at step" in read_log(w1), read_log(w1)[-3000:]
            assert proxy.connections >= 2  # it came back through a new connection
            status = client.status()
            assert not worker_record(status, 1).dead
            assert status.version == steps
            assert status.rounds_aborted == 0 and status.rounds_timed_out == 0
            assert server.poll() is None
    finally:
        proxy.close()
