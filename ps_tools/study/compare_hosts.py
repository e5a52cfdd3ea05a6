"""ps-compare's links: a scenario's network on emulated hosts, or with the sleep knobs.

    kinds, notes = plan_links("auto", ["bandwidth", "straggler"], SCENARIOS)
    run = run_on_hosts(launch_argv, network, workers, run_dir, timeout)

A scenario with a ``Network`` (a rate and/or a latency) runs in one of two ways:

* ``sleep``: on loopback through ps-launch, every worker given the experiment knobs
  ``--bandwidth-mbps R --added-latency-ms L``, which sleep before each push
  ``L + bytes/R`` and before each pull ``L`` (docs/compare.md, "Experiment knobs"):
  each worker pays for its own push as if on a link of its own; nothing is shared.
* ``emulated``: ``ps_tools.hosts``: one host for the server (``tfps-ps-0``), one per
  worker (``tfps-worker-I``), every host's link shaped with ``tc tbf`` at R in each
  direction, and the latency added by the relay in the server's host (L each way, so
  2L more round-trip time on every call). The workers reach the server by host name
  (``--ps tfps-ps-0:2222``); the server's one link carries all N workers' pushes in
  and all their pulls out, with real queueing and TCP.

The processes are ps-launch's own: ``launch.server_argv`` and ``launch.worker_argv``
of the ps-launch command line ps-compare would run (``--worker-args`` included:
history files, the chief's evaluations, the non-network knobs), started in the
hosts instead of on loopback, and the chief's result turned into the same
metrics.json ps-launch writes.

``--links``: ``auto`` (default: emulated where this machine can, ``hosts.unavailable()``
is None, otherwise the sleep knobs, saying so), ``emulated`` (an error in one line
where it cannot), ``sleep``, ``both`` (each network scenario twice, to compare what
the two conclude; needs emulated hosts). Scenarios without a network (balanced,
straggler, pause) always run with their knobs on loopback.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from ps_tools import hosts as hosts_mod

LINK_CHOICES = ("auto", "emulated", "sleep", "both")
PS_HOST = "tfps-ps-0"
PORT = 2222  # where the workers reach the server: the relay in the server's host


@dataclasses.dataclass(frozen=True)
class Network:
    """A scenario's links: ``rate_mbps`` (0: unlimited) and ``latency_ms``."""

    rate_mbps: float = 0.0
    latency_ms: float = 0.0

    def sleep_knobs(self) -> str:
        return f"--bandwidth-mbps {self.rate_mbps:g} --added-latency-ms {self.latency_ms:g}"

    def tc_rate(self) -> str | None:
        return f"{self.rate_mbps * 1000:g}kbit" if self.rate_mbps else None


class LinksError(RuntimeError):
    pass


def describe(kind: str, network: Network | None) -> str:
    """How a run's network is made, in the report's words."""
    if network is None:
        return "loopback (no network condition)"
    if kind == "sleep":
        return f"sleep knobs on loopback: {network.sleep_knobs()} on every worker"
    parts = [f"tc tbf {network.rate_mbps:g} Mbit/s per host" if network.rate_mbps else "unshaped links"]
    parts.append(f"{network.latency_ms:g} ms each way by relay" if network.latency_ms else "no added latency")
    return "emulated hosts: " + ", ".join(parts)


def plan_links(choice: str, names: list[str], scenarios: dict, why_not=None) -> tuple[dict, list[str]]:
    """{scenario: [link kinds, in run order]} and notes to print; LinksError if ``choice``
    needs emulated hosts this machine cannot make. ``why_not``: ``hosts.unavailable``'s answer
    (computed when not given)."""
    if choice not in LINK_CHOICES:
        raise LinksError(f"--links {choice!r}: use {', '.join(LINK_CHOICES)}")
    networked = [n for n in names if scenarios[n].network is not None]
    notes: list[str] = []
    why = None
    if networked and choice != "sleep":
        why = hosts_mod.unavailable() if why_not is None else (why_not or None)
    if why and choice in ("emulated", "both"):
        raise LinksError(f"--links {choice}: {why} (--links sleep or auto use the sleep knobs)")
    plan = {}
    for n in names:
        if scenarios[n].network is None:
            plan[n] = ["loopback"]
        elif choice == "both":
            plan[n] = ["sleep", "emulated"]
        elif choice == "sleep" or why:
            plan[n] = ["sleep"]
        else:
            plan[n] = ["emulated"]
    if why and choice == "auto":
        notes.append(f"--links auto: {why}; {', '.join(networked)} use(s) the sleep knobs instead")
    return plan, notes


def host_names(workers: int) -> list[str]:
    return [PS_HOST] + [f"tfps-worker-{i}" for i in range(workers)]


def run_on_hosts(launch_argv: list[str], network: Network, run_dir: str, timeout: float) -> dict:
    """``_run_on_hosts``, with a failure to make the hosts as a LinksError."""
    try:
        return _run_on_hosts(launch_argv, network, run_dir, timeout)
    except hosts_mod.HostsError as e:
        raise LinksError(f"the emulated hosts: {e}") from None


def _run_on_hosts(launch_argv: list[str], network: Network, run_dir: str, timeout: float) -> dict:
    """ps-launch's processes for ``launch_argv`` (its arguments, without the program) on
    emulated hosts shaped as ``network``; the metrics ps-launch would write, also written to
    ``run_dir/metrics.json``. Logs: ``run_dir/server.log``, ``worker<I>.log``."""
    from ps_common.procs import ServerStartError, wait_for_port_file
    from ps_tools import launch

    args = launch.parser().parse_args(launch_argv)
    args.command = []
    try:
        extra = launch.worker_extra_args(args)
        env = launch.child_environment()
        server_config, _ = launch.resolved(args, extra, env)
    except launch.LaunchError as e:
        raise LinksError(str(e)) from None
    env.setdefault("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    names = host_names(args.workers)
    procs: list[subprocess.Popen] = []
    logs = []

    def start(hosts, host, argv, label):
        log = open(os.path.join(run_dir, f"{label}.log"), "w")
        logs.append(log)
        proc = hosts.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        proc.label = label
        procs.append(proc)
        return proc

    def tail(label):
        try:
            with open(os.path.join(run_dir, f"{label}.log")) as f:
                return f.read()[-2000:]
        except OSError:
            return ""

    started = time.monotonic()
    with hosts_mod.Hosts(names, rate=network.tc_rate()) as hosts, \
            tempfile.TemporaryDirectory(prefix="ps-compare-") as tmp:
        try:
            port_file = os.path.join(tmp, "port")
            server = start(hosts, PS_HOST, launch.server_argv(args, 0, port_file), "server")
            try:
                port = wait_for_port_file(port_file, server, args.server_start_timeout)
            except ServerStartError as e:
                raise LinksError(f"{e}; the end of server.log:\n{tail('server')}") from None
            relay = hosts.relay(PS_HOST, PORT, port, delay_ms=network.latency_ms)
            procs.append(relay)
            _wait_serving(hosts, f"{PS_HOST}:{PORT}", env, args.server_start_timeout)
            result_file = os.path.join(tmp, "result.json")
            workers = []
            for i in range(args.workers):
                argv = launch.worker_argv(args, i, [f"{PS_HOST}:{PORT}"], extra.get(i, []))
                if i == 0:
                    argv += ["--result-json", result_file]
                workers.append(start(hosts, names[i + 1], argv, f"worker{i}"))
            _wait_for_workers(workers, server, names, timeout, run_dir, tail)
            wall_s = time.monotonic() - started
            with open(result_file) as f:
                result = json.load(f)
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    metrics = {key: result[key] for key in ("steps", "test_accuracy", "final_loss", "examples_per_s", "train_s",
                                            "test_loss", "mean_staleness", "max_staleness")}
    metrics.update(mode=server_config.mode, workers=args.workers, wall_s=wall_s, num_ps=1,
                   links=describe("emulated", network))
    if args.metrics_json:
        with open(args.metrics_json, "w") as f:
            json.dump(metrics, f, indent=2)
    return metrics


def _wait_for_workers(workers: list, server, names: list[str], timeout: float, run_dir: str, tail) -> None:
    """Until every worker exited 0; LinksError, with the end of its log, for one that
    failed, for the server ending first, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [w.poll() for w in workers]
        bad = [w for w, c in zip(workers, codes) if c not in (None, 0)]
        if bad:
            host = names[1 + workers.index(bad[0])]
            raise LinksError(f"{bad[0].label} exited with status {bad[0].returncode} on {host}; "
                             f"the end of its log:\n{tail(bad[0].label)}")
        if server.poll() is not None:
            raise LinksError(f"ps-server exited with status {server.returncode} while training; "
                             f"the end of server.log:\n{tail('server')}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise LinksError(f"not finished within {timeout:g} s on emulated hosts; logs in {run_dir}")
        time.sleep(0.1)


def _wait_serving(hosts, address: str, env: dict, timeout: float) -> None:
    """Until the server answers SERVING through the relay, asked from the first worker's host."""
    script = ("import sys\nfrom worker.client import PSClient\n"
              f"with PSClient({address!r}) as c:\n    c.wait_ready({timeout!r})\n")
    done = hosts.run(host_names(1)[1], [sys.executable, "-c", script], timeout=timeout + 30, env=env)
    if done.returncode != 0:
        raise LinksError(f"ps-server at {address} did not serve on the emulated hosts: "
                         f"{done.stderr.strip()[-1000:]}")


def launch_command_text(launch_argv: list[str], network: Network) -> str:
    return f"on emulated hosts ({describe('emulated', network)}): ps-launch {shlex.join(launch_argv)}"
