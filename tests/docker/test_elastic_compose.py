"""docker/compose.elastic.yaml run for real: `up --scale worker=4` adds workers to a running job.

    python -m pytest tests/docker/test_elastic_compose.py -q     # builds the images first

Elastic sync in containers: `up -d` starts the server and its two first workers; once
they are inside round PAUSE_AT (where both pause for a while, tests/docker/compose.pause.yaml,
so that the short job is surely still running when the new containers are ready),
`up -d --scale worker=4 --no-recreate` adds two. The added workers get indexes 2 and 3
(the chief stays worker 0), join at the next round and train to the job's last round;
every container exits 0, the server counted every example of each epoch exactly once,
and the chief's final weights are those of an undisturbed run of the same job by two
workers, bit for bit.
"""

import json
import os
import time

import pytest

from tests.docker.conftest import run
from tests.docker.test_compose import _exit_codes, _metrics

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

ELASTIC = ("compose.yaml", "compose.elastic.yaml")
PAUSE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compose.pause.yaml")
EXAMPLES = 1437  # digits' training examples
EPOCHS = 3
STEPS = 69  # 3 epochs of global batches of 64: 22 full ones and one of 29 each
PAUSE_AT, PAUSE_FOR = 10, 45
RUN_TIMEOUT = 600
# The same job in both runs; a barrier timeout above the pause (nobody pushes meanwhile).
JOB = dict(TFPS_EPOCHS=EPOCHS, TFPS_BARRIER_TIMEOUT=120)

# The final weights, one digest per array (an .npz holds zip timestamps: its bytes differ).
DIGESTS = ("import hashlib, json, numpy as np; d = np.load('/data/weights.npz'); "
           "print(json.dumps({k: [str(v.dtype), list(v.shape), hashlib.sha256(v.tobytes()).hexdigest()] "
           "for k, v in d.items()}))")


def _weights(project) -> dict:
    out = run(["docker", "run", "--rm", "-v", f"{project.volume('results')}:/data:ro", "--entrypoint", "python",
               project.images.server, "-c", DIGESTS]).stdout
    return json.loads(out)


def _last_status_while_the_server_runs(project, timeout: float) -> dict:
    """Status, asked until the server exits: the last answer it gave."""
    server, last = project.server(), None
    deadline = time.monotonic() + timeout
    while project.state(server)["Running"]:
        last = project.status() or last
        assert time.monotonic() < deadline, f"the server still runs after {timeout} s\n{project.all_logs()}"
        time.sleep(0.5)
    assert last is not None, project.all_logs()
    return last


@pytest.mark.slow  # 90 s; the same elastic scaling runs in the default tier under ps-launch (tests/cluster)
def test_workers_added_by_compose_scale_join_the_running_job_which_ends_with_the_undisturbed_bits(compose_project):
    scaled = compose_project(files=(*ELASTIC, PAUSE), TFPS_PAUSE_AT_STEP=PAUSE_AT, TFPS_PAUSE_FOR=PAUSE_FOR, **JOB)
    scaled.up_detached()
    first = set(scaled.containers("worker"))
    assert len(first) == 2
    paused = scaled.wait_for(lambda s: s["version"] >= PAUSE_AT, RUN_TIMEOUT, f"{PAUSE_AT} elastic rounds")
    assert paused["version"] == PAUSE_AT, paused  # both first workers pause inside this round
    # The added workers do not pause; --no-recreate leaves the running two as they are.
    scaled.env.update(TFPS_PAUSE_AT_STEP="0", TFPS_PAUSE_FOR="0")
    scaled.compose("up", "-d", "--no-build", "--scale", "worker=4", "--no-recreate", timeout=300)
    added = set(scaled.containers("worker")) - first
    assert len(added) == 2
    for cid in added:
        env = json.loads(run(["docker", "inspect", "-f", "{{json .Config.Env}}", cid]).stdout)
        assert "TFPS_PAUSE_FOR=0" in env and "TFPS_ELASTIC=1" in env, env
    last = _last_status_while_the_server_runs(scaled, RUN_TIMEOUT)
    codes = scaled.wait_exited(60)
    named = _exit_codes(scaled, codes)
    assert named == {"server": 0, "worker0": 0, "worker1": 0, "worker2": 0, "worker3": 0}, scaled.all_logs()
    # The chief is one of the first two; the added containers took the next free indexes.
    by_index = {w["id"]: w for w in last["workers"]}
    assert added == {scaled.worker_container(i, last) for i in (2, 3)}
    assert sorted(by_index) == [0, 1, 2, 3] and all(w["pushes"] > 0 for w in by_index.values()), last
    # Every example of each epoch once: 3 x 1437, in one update per round.
    metrics = _metrics(scaled)
    assert metrics["mode"] == "sync" and metrics["steps"] == metrics["version"] == STEPS, metrics
    assert metrics["examples"] == EPOCHS * EXAMPLES, metrics
    assert metrics["test_accuracy"] >= 0.90, metrics
    server_log = scaled.logs(scaled.server())
    # Each of the four finished, none was declared dead (the last status may predate the leaves).
    assert "every worker is done (finished: [0, 1, 2, 3], declared dead: none)" in server_log, server_log[-3000:]
    for cid in added:  # the added workers joined a round after the pause began, and ran to the end
        log = scaled.logs(cid)
        assert f"finished {STEPS} steps" in log and "final:" not in log, log[-3000:]

    undisturbed = compose_project(files=ELASTIC, **JOB)
    undisturbed.compose("up", "--no-build", "--no-color", timeout=RUN_TIMEOUT)
    codes = _exit_codes(undisturbed, undisturbed.wait_exited(30))
    assert codes == {"server": 0, "worker0": 0, "worker1": 0}, undisturbed.all_logs()
    assert _metrics(undisturbed)["examples"] == EPOCHS * EXAMPLES
    quiet, churned = _weights(undisturbed), _weights(scaled)
    assert quiet and churned == quiet


def test_the_elastic_compose_settings_resolve_to_an_elastic_server_and_workers_that_agree(docker_engine):
    """`docker-compose config` of the elastic files, each service's environment read by the
    program's own configuration code (with the image's ENV, as ps_tools.kube knows it)."""
    yaml = pytest.importorskip("yaml")
    from ps_common.settings import ConfigError
    from ps_server.config import ServerConfig
    from ps_tools.kube import IMAGE_ENV
    from tests.docker.conftest import Compose, Images
    from worker.config import AUTO_INDEX, WorkerConfig

    def env(service: dict, image: str) -> dict:
        return {**IMAGE_ENV[image], **{k: str(v) for k, v in service["environment"].items()}}

    def resolved(**settings):
        config = yaml.safe_load(Compose(Images("python:3.11-slim", {}), ELASTIC, **settings).compose("config").stdout)
        server, worker = config["services"]["server"], config["services"]["worker"]
        return (ServerConfig.from_args([], env(server, "tfps-server")),
                WorkerConfig.from_args([], env(worker, "tfps-worker")), worker["scale"])

    ps, worker, scale = resolved()
    assert (ps.mode, ps.elastic_min_workers, ps.num_workers, ps.micro_batches) == ("sync", 2, 4, 4)
    assert ps.exit_when_done
    assert worker.elastic and worker.worker_index == AUTO_INDEX and worker.num_workers == ps.num_workers
    assert scale == ps.elastic_min_workers  # `up` starts the minimum
    ps, worker, scale = resolved(TFPS_ELASTIC_MIN_WORKERS=3, TFPS_ELASTIC_MAX_WORKERS=8, TFPS_MICRO_BATCHES=8)
    assert (ps.elastic_min_workers, ps.num_workers, worker.num_workers, scale) == (3, 8, 8, 3)
    with pytest.raises(ConfigError, match="above --num-workers"):
        resolved(TFPS_ELASTIC_MIN_WORKERS=5)
