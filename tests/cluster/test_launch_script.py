"""``ps-launch ... -- COMMAND``: the user's own script runs as every worker (ps_tools/launch.py).

The rule: each worker gets ``TF_CONFIG`` and the workers' ``TFPS_*`` settings, so that
``WorkerConfig.from_args([], os.environ)`` in the script resolves its index, the worker
count and every server; ps-launch exits with the chief's status; a worker that fails
before the chief stops everything, named with its status in one line; the built-in
ps-worker's flags are refused with a command. The scripts are tiny Python programs (no
TensorFlow), each of which ends by itself.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.cluster

# Prints what a script using tfps' API resolves, and asks every server for its status
# (with the token the configuration names: the servers refuse calls without it).
RESOLVE = r'''
import json, os, sys
from ps_common import security
from worker.client import PSClient
from worker.config import WorkerConfig

c = WorkerConfig.from_args([], os.environ)
token = security.load_token(c.auth_token_file, os.environ)
counts = []
for address in c.ps_addresses:
    with PSClient(address, timeout=10.0, token=token) as client:
        counts.append(client.status().num_workers)
spec = json.loads(os.environ["TF_CONFIG"])
print(f"resolved worker_index={c.worker_index} num_workers={c.num_workers} ps={c.ps} "
      f"servers_count_workers={counts} shm={c.shm} max_message_mb={c.max_message_mb:g} "
      f"log_level={c.log_level} token_file={c.auth_token_file}", flush=True)
print("cluster " + json.dumps(spec), flush=True)
print(f"to stderr from {c.worker_index}", file=sys.stderr, flush=True)
'''

# Worker 0 exits 3, the others 0.
CHIEF_FAILS = r'''
import os, sys
from worker.config import WorkerConfig

sys.exit(3 if WorkerConfig.from_args([], os.environ).worker_index == 0 else 0)
'''

# The chief writes the pids of every process ps-launch started (its siblings) and sleeps
# 60 s; worker 1 waits for that file, notes the time and exits 7; the others sleep 60 s.
ONE_FAILS = r'''
import os, sys, time
from worker.config import WorkerConfig

out = sys.argv[1]
index = WorkerConfig.from_args([], os.environ).worker_index
launcher = os.getppid()
if index == 0:
    siblings = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == launcher:
                        siblings.append(int(entry))
            except OSError:
                pass
    with open(os.path.join(out, "pids.tmp"), "w") as f:
        f.write(" ".join(map(str, siblings)))
    os.replace(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
elif index == 1:
    deadline = time.monotonic() + 20
    while not os.path.exists(os.path.join(out, "pids")) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(out, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    sys.exit(7)
time.sleep(60)
'''


def _launch(tmp_path, script: str, *flags: str, timeout: float = 60, env: dict | None = None):
    path = tmp_path / "script.py"
    path.write_text(script)
    base = {k: v for k, v in os.environ.items() if k != "TFPS_AUTH_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", *flags, "--", sys.executable, str(path), str(tmp_path)],
        capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})},
    )


def _output(run) -> str:
    return f"rc={run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"


def test_every_worker_resolves_its_place_and_reaches_every_server(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-launch-token\n")
    token.chmod(0o600)
    # These would win over TF_CONFIG if ps-launch passed them on.
    stale = {"TFPS_PS": "10.9.9.9:1", "TFPS_WORKER_INDEX": "5", "TFPS_NUM_WORKERS": "9"}
    run = _launch(tmp_path, RESOLVE, "--mode", "async", "--workers", "3", "--num-ps", "2", "--auth-token-file",
                  str(token), "--shm", "--max-message-mb", "64", "--log-level", "INFO", env=stale)
    assert run.returncode == 0, _output(run)
    lines = run.stdout.splitlines()
    assert re.fullmatch(r"ps-launch: async, 3 workers and 2 ps-server shards on loopback, running .*script\.py .*",
                        lines[0]), lines[:3]
    listening = [re.search(r"^\[ps (\d)\] .*listening on (127\.0\.0\.1:\d+) ", line) for line in lines]
    servers = dict(m.groups() for m in listening if m)
    assert sorted(servers) == ["0", "1"], _output(run)
    ps = f"{servers['0']},{servers['1']}"
    worker_entries = set()
    for i in range(3):
        assert (f"[worker {i}] resolved worker_index={i} num_workers=3 ps={ps} servers_count_workers=[3, 3] "
                f"shm=True max_message_mb=64 log_level=INFO token_file={token}") in lines, _output(run)
        cluster = json.loads(next(line for line in lines if line.startswith(f"[worker {i}] cluster "))
                             .split(" cluster ", 1)[1])
        assert cluster["task"] == {"type": "worker", "index": i}
        assert set(cluster["cluster"]) == {"ps", "worker"}  # worker 0 is the chief: no chief entry
        assert cluster["cluster"]["ps"] == [servers["0"], servers["1"]]
        worker_entries.add(tuple(cluster["cluster"]["worker"]))
        assert f"[worker {i}] to stderr from {i}" in run.stderr.splitlines()  # stderr stays stderr
    (entries,) = worker_entries  # the same cluster for all
    assert len(set(entries)) == 3 and all(re.fullmatch(r"127\.0\.0\.1:\d+", e) for e in entries), entries


def test_the_launcher_exits_with_the_chiefs_status(tmp_path):
    run = _launch(tmp_path, CHIEF_FAILS, "--workers", "2")
    assert run.returncode == 3, _output(run)
    assert "ps-launch: worker 0 (the chief) exited with status 3" in run.stderr.splitlines(), _output(run)


def test_workers_still_running_after_the_chief_succeeded_are_stopped(tmp_path):
    script = ("import os, sys, time\nfrom worker.config import WorkerConfig\n"
              "if WorkerConfig.from_args([], os.environ).worker_index == 1:\n    time.sleep(60)\n")
    started = time.monotonic()
    run = _launch(tmp_path, script, "--workers", "2", timeout=45)
    assert run.returncode == 0, _output(run)
    assert time.monotonic() - started < 30, _output(run)
    assert "ps-launch: worker 1 still running 5 s after the chief exited; stopping it" in run.stderr.splitlines()


def test_a_worker_failing_before_the_chief_stops_everything(tmp_path):
    started = time.monotonic()
    run = _launch(tmp_path, ONE_FAILS, "--workers", "3", timeout=45)
    ended = time.time()
    assert run.returncode == 1, _output(run)
    assert time.monotonic() - started < 30, _output(run)  # the chief and worker 2 would sleep 60 s
    failed_at = float((tmp_path / "failed_at").read_text())
    assert ended - failed_at < 10, (ended - failed_at, _output(run))
    said = [line for line in run.stderr.splitlines() if line.startswith("ps-launch: ")]
    assert said == ["ps-launch: worker 1 exited with status 7 before the chief finished; "
                    "stopping the other workers and the servers"], _output(run)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 4, pids  # the server and three workers, as the chief saw them
    assert [p for p in pids if os.path.exists(f"/proc/{p}")] == []  # stopped and waited for


@pytest.mark.parametrize("flags, named", [
    (("--epochs", "3", "--save-model", "m.keras"), "--save-model, --epochs"),
    (("--dataset", "digits", "--worker-args", "1", "--slowdown 2", "--metrics-json", "m.json"),
     "--metrics-json, --worker-args, --dataset"),
    (("--no-deterministic",), "--no-deterministic"),
])
def test_the_built_in_workers_flags_are_refused_with_a_command(tmp_path, flags, named):
    run = _launch(tmp_path, "raise SystemExit('never run')\n", "--workers", "2", *flags, timeout=30)
    assert run.returncode == 2, _output(run)
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, _output(run)
    assert run.stderr.startswith(f"ps-launch: error: {named}: the built-in ps-worker's"), _output(run)
    assert run.stdout == ""  # nothing started


def test_print_config_with_a_command_shows_each_workers_environment(tmp_path):
    run = _launch(tmp_path, "raise SystemExit('never run')\n", "--print-config", "--workers", "2", "--num-ps", "2",
                  "--metrics-port", "9400", "--shm", timeout=30)
    assert run.returncode == 0, _output(run)
    doc = json.loads(run.stdout)
    assert doc["launch"]["command"][-2:] == [str(tmp_path / "script.py"), str(tmp_path)]
    assert [(w["worker_index"], w["num_workers"], w["metrics_port"], w["shm"]) for w in doc["workers"]] == \
        [(0, 2, 9402, True), (1, 2, 9403, True)]
    env = doc["worker_environment"]
    assert [json.loads(e["TF_CONFIG"])["task"] for e in env] == [{"type": "worker", "index": 0},
                                                                 {"type": "worker", "index": 1}]
    assert [(e["TFPS_WORKER_METRICS_PORT"], e["TFPS_WORKER_SHM"]) for e in env] == [("9402", "true"),
                                                                                    ("9403", "true")]
