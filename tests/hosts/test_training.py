"""tfps across emulated machines: one process per host, host names in TF_CONFIG, real links.

Every host's link is shaped to 1 Gbit/s (``ps_tools.hosts``); the workers ask for the
same-host shared-memory path and, each host having its own /dev/shm, fall back to
the wire as on real separate machines.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.hosts.conftest import PORT, read_log, tf_config, wait_exit

pytestmark = pytest.mark.hosts

PS = "tfps-ps-0"
WORKERS = ["tfps-worker-0", "tfps-worker-1", "tfps-worker-2"]
RUN_TIMEOUT = 300


def _cluster(ps_hosts, worker_hosts):
    return {"ps": [f"{h}:{PORT}" for h in ps_hosts], "worker": [f"{h}:{PORT}" for h in worker_hosts]}


def _start(c, cluster, ps_hosts, worker_hosts, server_flags=(), worker_flags=(), chief_flags=()):
    servers = [c.server(h, *server_flags, env={"TF_CONFIG": tf_config(cluster, "ps", i)})
               for i, h in enumerate(ps_hosts)]
    for h, s in zip(ps_hosts, servers):
        c.wait_serving(h, f"{h}:{PORT}", s)
    workers = [c.worker(h, *worker_flags, *(chief_flags if i == 0 else ()),
                        env={"TF_CONFIG": tf_config(cluster, "worker", i)})
               for i, h in enumerate(worker_hosts)]
    return servers, workers


# async on hosts (~18 s) is slow: the hosts' links are the sync run's, and async training to
# 90 % is the cluster tier's (tests/cluster/test_keras_fit.py's ParameterServerStrategy example).
@pytest.mark.parametrize("mode,epochs", [("sync", 3), pytest.param("async", 6, marks=pytest.mark.slow)])
def test_one_ps_host_and_three_worker_hosts_train_digits_to_90_percent(host_cluster, tmp_path, mode, epochs):
    c = host_cluster([PS, *WORKERS], rate="1gbit")
    result = tmp_path / "result.json"
    servers, workers = _start(
        c, _cluster([PS], WORKERS), [PS], WORKERS,
        server_flags=("--mode", mode, "--exit-when-done"),
        worker_flags=("--dataset", "digits", "--epochs", str(epochs), "--shm"),
        chief_flags=("--result-json", str(result)))
    for w in workers:
        assert wait_exit(w, RUN_TIMEOUT) == 0, read_log(w)[-3000:]
    assert wait_exit(servers[0], 60) == 0, read_log(servers[0])[-3000:]
    r = json.loads(result.read_text())
    assert r["mode"] == mode and r["test_accuracy"] >= 0.90, r
    server_log = read_log(servers[0])
    for i, host in enumerate(WORKERS):
        # Each worker registered under its own host's name, from its own address.
        assert f"{host}:" in server_log, server_log[-3000:]
        # Separate /dev/shm: the fast path fell back to the wire, as between machines.
        assert "same-host shared memory off" in read_log(workers[i]), read_log(workers[i])[-3000:]


def _status_until(c, host, address, predicate, timeout, what, procs=()):
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = c.status(host, address, timeout=5)
            if predicate(s):
                return s
        except AssertionError:
            pass
        for p in procs:
            assert p.poll() is None, f"{p.label} exited {p.returncode} waiting for {what}:\n{read_log(p)[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.3)


MANIFESTS = {
    # deploy/kubernetes/...: the replicas (role, index) each manifest makes
    "tfjob.yaml": [("ps", 0), ("ps", 1), ("chief", 0), ("worker", 0), ("worker", 1)],
    "plain": [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)],
}


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_the_kubernetes_replicas_train_on_hosts_of_their_own_with_the_names_and_tf_config_they_get(
        host_cluster, tmp_path, manifest):
    """deploy/kubernetes/: the TFJob (two PS replicas as shards, a chief, two workers,
    with the TF_CONFIG the training-operator writes) and the plain manifests (a StatefulSet
    of two shards behind a headless Service, an indexed Job of three --worker-index auto
    workers): each replica run with exactly the environment and command it gets
    (ps_tools.kube), on a host named as its pod is reached, answering to its other names."""
    import os
    import sys

    from ps_tools import kube

    replicas = kube.replicas(os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "kubernetes", manifest))
    assert [(r.role, r.index) for r in replicas] == MANIFESTS[manifest]
    c = host_cluster([r.hostname for r in replicas], rate="1gbit",
                     aliases={r.hostname: r.names for r in replicas})
    programs = {"ps-server": [sys.executable, "-m", "ps_server"], "ps-worker": [sys.executable, "-m", "worker"]}
    # The pods' volumes are directories here; everything else is as the manifest says.
    local = {"TFPS_RESULT_JSON": str(tmp_path / "metrics.json"), "TFPS_SAVE_MODEL": str(tmp_path / "model.keras"),
             "TFPS_SAVE_WEIGHTS": str(tmp_path / "weights.npz")}
    procs = {}
    for r in replicas:
        env = {**r.env, **{k: local[k] for k in r.env if k in local}}
        if "TFPS_CHECKPOINT_DIR" in env:
            env["TFPS_CHECKPOINT_DIR"] = str(tmp_path / "checkpoints" / r.pod_name)
        argv = programs[r.process_argv[0]] + list(r.process_argv[1:])
        procs[r.role, r.index] = c.start(r.hostname, argv, f"{r.role}{r.index}", env=env)
        if r.role == "ps":
            c.wait_serving(r.hostname, f"{r.hostname}:{r.port}", procs[r.role, r.index])
    trainers = [r for r in replicas if r.role != "ps"]
    for r in trainers:
        assert wait_exit(procs[r.role, r.index], RUN_TIMEOUT) == 0, read_log(procs[r.role, r.index])[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["test_accuracy"] >= 0.90, metrics
    statuses = [c.status(r.hostname, f"{r.hostname}:{r.port}") for r in replicas if r.role == "ps"]
    # Both shards completed every round, and know every trainer by its pod's name.
    assert statuses[0]["round"] == statuses[1]["round"] > 0, statuses
    names = sorted((w["id"], w["name"].split(":")[0]) for w in statuses[0]["workers"])
    if manifest == "tfjob.yaml":  # the chief is worker 0, the workers 1 and 2
        assert names == [(0, trainers[0].hostname), (1, trainers[1].hostname), (2, trainers[2].hostname)], names
    else:  # --worker-index auto: the server hands out 0, 1, 2 in the order they register
        assert [i for i, _ in names] == [0, 1, 2] and sorted(n for _, n in names) == \
            sorted(r.hostname for r in trainers), names


def test_a_worker_host_cut_off_longer_than_the_lease_is_declared_dead_and_rejoins(host_cluster, tmp_path):
    workers = WORKERS[:2]
    c = host_cluster([PS, *workers], rate="1gbit")
    result = tmp_path / "result.json"
    address = f"{PS}:{PORT}"
    servers, procs = _start(
        c, _cluster([PS], workers), [PS], workers,
        server_flags=("--mode", "sync", "--exit-when-done", "--lease-timeout", "3", "--dead-worker-policy", "wait",
                      "--replacement-timeout", "120"),
        worker_flags=("--dataset", "digits", "--epochs", "4", "--reconnect-timeout", "120"),
        chief_flags=("--result-json", str(result)))
    _status_until(c, PS, address, lambda s: s["version"] >= 10, RUN_TIMEOUT, "10 sync rounds", procs)
    c.hosts.cut(workers[1])
    try:
        cut = _status_until(c, PS, address, lambda s: any(w["id"] == 1 and w["dead"] for w in s["workers"]), 60,
                            "worker 1 declared dead")
        # Policy wait: the round waits for worker 1's index; nothing is applied meanwhile.
        time.sleep(2)
        assert c.status(PS, address)["version"] <= cut["version"] + 1
    finally:
        c.hosts.restore(workers[1])
    for w in procs:
        assert wait_exit(w, RUN_TIMEOUT) == 0, read_log(w)[-3000:]
    assert wait_exit(servers[0], 60) == 0, read_log(servers[0])[-3000:]
    server_log = read_log(servers[0])
    assert "declared dead" in server_log and server_log.count("worker 1 registered") >= 2, server_log[-4000:]
    r = json.loads(result.read_text())
    assert r["test_accuracy"] >= 0.90, r


def test_a_ps_host_whose_processes_are_killed_restarts_from_its_checkpoint_and_the_workers_finish(host_cluster,
                                                                                                  tmp_path):
    workers = WORKERS[:2]
    c = host_cluster([PS, *workers], rate="1gbit")
    result = tmp_path / "result.json"
    address = f"{PS}:{PORT}"
    server_flags = ("--mode", "sync", "--exit-when-done", "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--checkpoint-interval", "0.5")
    servers, procs = _start(
        c, _cluster([PS], workers), [PS], workers, server_flags=server_flags,
        worker_flags=("--dataset", "digits", "--epochs", "4", "--reconnect-timeout", "120"),
        chief_flags=("--result-json", str(result)))
    _status_until(c, PS, address, lambda s: s["version"] >= 15, RUN_TIMEOUT, "15 sync rounds", procs)
    c.hosts.kill_all(PS)  # the machine lost power: every process on it, at once
    assert servers[0].wait(timeout=30) != 0
    again = c.server(PS, *server_flags, env={"TF_CONFIG": tf_config(_cluster([PS], workers), "ps", 0)},
                     label="server-again")
    for w in procs:
        assert wait_exit(w, RUN_TIMEOUT) == 0, read_log(w)[-3000:]
    assert wait_exit(again, 60) == 0, read_log(again)[-3000:]
    assert "restored" in read_log(again).lower(), read_log(again)[-3000:]
    assert any("rejoined" in read_log(w) for w in procs)
    r = json.loads(result.read_text())
    assert r["test_accuracy"] >= 0.90, r


def test_links_with_one_percent_loss_and_added_latency_train_with_no_update_applied_twice(host_cluster, tmp_path):
    """Every link drops 1 % of packets each way; the PS host's relay adds 5 ms each way
    (ps_tools.hosts: this kernel has no netem). TCP retransmits; gRPC calls that fail
    are retried; the server applies each round exactly once."""
    workers = WORKERS[:2]
    c = host_cluster([PS, *workers], rate="1gbit", loss=0.01)
    cluster = _cluster([PS], workers)
    result = tmp_path / "result.json"
    server = c.server(PS, "--mode", "sync", "--host", "127.0.0.1", "--port", str(PORT + 1),
                      env={"TF_CONFIG": tf_config(cluster, "ps", 0)})
    c.hosts.relay(PS, PORT, PORT + 1, delay_ms=5)
    c.wait_serving(PS, f"{PS}:{PORT}", server)
    steps = 40
    procs = [c.worker(h, "--dataset", "digits", "--steps", str(steps), "--reconnect-timeout", "120",
                      *(("--result-json", str(result)) if i == 0 else ()),
                      env={"TF_CONFIG": tf_config(cluster, "worker", i)}) for i, h in enumerate(workers)]
    for w in procs:
        assert wait_exit(w, RUN_TIMEOUT) == 0, read_log(w)[-3000:]
    s = c.status(PS, f"{PS}:{PORT}")
    # One update per round, each worker's push counted once, however often a call was retried.
    assert s["version"] == s["round"] == steps and s["pushes_applied"] == len(workers) * steps, s
    r = json.loads(result.read_text())
    assert r["steps"] == steps and r["test_accuracy"] >= 0.85, r
