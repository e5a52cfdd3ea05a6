"""docker/compose.yaml run for real: training, a killed worker, a killed server, a cut network.

    python -m pytest tests/docker -q          # builds the images first (a few minutes)

Each test starts its own compose project (one server, two workers scaled from one
service, indexes assigned by the server), drives it with `docker kill`, `docker
start` and `docker network disconnect/connect`, and reads the outcome from the
containers' exit codes, their logs and the results volume. See conftest.py for
the images and the teardown.
"""

import json

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

RUN_TIMEOUT = 600
# Long enough to be interrupted mid-run: 30 epochs of digits are ~670 sync rounds.
LONG_EPOCHS = 30


def _metrics(project) -> dict:
    return json.loads(project.read_file("results", "/data/metrics.json"))


def _exit_codes(project, codes: dict[str, int]) -> dict[str, int]:
    """{"server": 0, "worker0": 0, "worker1": 137} from {container: code}."""
    named = {}
    for cid, code in codes.items():
        if cid in project.containers("server"):
            named["server"] = code
            continue
        log = project.logs(cid)
        index = log.split("registered as worker ", 1)[1].split()[0] if "registered as worker " in log else "?"
        named[f"worker{index}"] = code
    return named


def test_images_run_as_a_non_root_user_and_only_the_worker_has_tensorflow(images):
    from tests.docker.conftest import run

    for image in (images.server, images.worker):
        assert run(["docker", "run", "--rm", "--entrypoint", "id", image, "-u"]).stdout.strip() == "10001"
    probe = "import importlib.util as u; print(u.find_spec('tensorflow') is not None)"
    assert run(["docker", "run", "--rm", images.server, "python", "-c", probe]).stdout.strip() == "False"
    assert run(["docker", "run", "--rm", images.worker, "python", "-c", probe]).stdout.strip() == "True"
    # Flags go to the program: the entrypoint passes them on.
    assert "--exit-when-done" in run(["docker", "run", "--rm", images.server, "--help"]).stdout
    size = {i: int(run(["docker", "image", "inspect", "-f", "{{.Size}}", i]).stdout) for i in (images.server, images.worker)}
    assert size[images.server] < size[images.worker] / 2, size


def test_compose_up_trains_digits_to_90_percent_and_every_container_exits_cleanly(compose_project):
    project = compose_project()
    # As docs/docker.md says: attached `up`, which returns once every container exited.
    project.compose("up", "--no-build", "--no-color", timeout=RUN_TIMEOUT)
    codes = _exit_codes(project, project.wait_exited(30))
    assert codes == {"server": 0, "worker0": 0, "worker1": 0}, project.all_logs()
    metrics = _metrics(project)
    assert metrics["mode"] == "sync" and metrics["workers"] == 2, metrics
    assert metrics["test_accuracy"] >= 0.90, metrics
    server_log = project.logs(project.server())
    assert "every worker is done (finished: [0, 1], declared dead: none)" in server_log, server_log[-3000:]
    assert f"final checkpoint: version {metrics['version']}" in server_log, server_log[-3000:]
    # The saved Keras model is the trained one: loaded in the worker image, it scores the same.
    from tests.docker.conftest import run

    script = ("import keras, numpy as np; from worker.data import load_dataset; d = load_dataset('digits'); "
              "m = keras.models.load_model('/data/model.keras'); "
              "print(float(np.mean(np.argmax(m.predict(d.x_test, verbose=0), 1) == d.y_test)))")
    out = run(["docker", "run", "--rm", "-v", f"{project.volume('results')}:/data:ro", project.images.worker,
               "python", "-c", script], timeout=300).stdout
    assert abs(float(out.strip().splitlines()[-1]) - metrics["test_accuracy"]) < 1e-6, (out, metrics)


# abort is slow: the same policy's chaos test runs in the default tier (tests/chaos), and
# shrink here proves the compose settings reach the server.
@pytest.mark.parametrize("policy", ["shrink", pytest.param("abort", marks=pytest.mark.slow)])
def test_killed_worker_gets_the_configured_policy(compose_project, policy):
    project = compose_project(TFPS_DEAD_WORKER_POLICY=policy, TFPS_LEASE_TIMEOUT=3, TFPS_EPOCHS=LONG_EPOCHS)
    project.up_detached()
    status = project.wait_for(lambda s: s["version"] >= 20, RUN_TIMEOUT, "20 sync rounds")
    victim = project.worker_container(1, status)
    from tests.docker.conftest import run

    run(["docker", "kill", victim])
    codes = project.wait_exited(RUN_TIMEOUT)
    named = _exit_codes(project, codes)
    server_log = project.logs(project.server())
    chief_log = project.logs(project.worker_container(0, status))
    assert named["worker1"] == 137  # SIGKILL
    assert "worker(s) 1" in server_log and "declared dead" in server_log, server_log[-3000:]
    assert named["server"] == 0, server_log[-3000:]  # --exit-when-done: nobody trains any more
    if policy == "shrink":
        # The chief finishes every round alone, weighted by its own batch share.
        assert named["worker0"] == 0, chief_log[-3000:]
        metrics = _metrics(project)
        assert metrics["version"] == metrics["steps"], metrics  # one update per round, none lost
        assert metrics["test_accuracy"] >= 0.90, metrics
        assert "every worker is done (finished: [0], declared dead: [1])" in server_log
    else:
        # Abort: the chief gets a clear error naming the dead worker and exits non-zero.
        assert named["worker0"] == 1, chief_log[-3000:]
        (error,) = [line for line in chief_log.splitlines() if line.startswith("ps-worker: error:")]
        assert "worker 0:" in error and "dead" in error and "1" in error, error
        assert "metrics.json" not in run(["docker", "run", "--rm", "-v", f"{project.volume('results')}:/data:ro",
                                          "--entrypoint", "ls", project.images.server, "/data"]).stdout


def test_killed_server_restarts_from_its_checkpoint_and_training_finishes(compose_project):
    project = compose_project(TFPS_CHECKPOINT_INTERVAL=1, TFPS_EPOCHS=LONG_EPOCHS)
    project.up_detached()
    # Killed once a checkpoint well into the run exists (its version is what a restart must restore at least).
    before = project.wait_for(lambda s: s["version"] >= 60 and s["last_checkpoint_version"] >= 20, RUN_TIMEOUT,
                              "60 sync rounds and a checkpoint of round 20 or later")
    server = project.server()
    from tests.docker.conftest import run

    run(["docker", "kill", server])
    assert project.state(server)["ExitCode"] == 137
    run(["docker", "start", server])
    after = project.wait_for(lambda s: s["incarnation"] != before["incarnation"], 120, "the restarted server")
    codes = _exit_codes(project, project.wait_exited(RUN_TIMEOUT))
    assert codes == {"server": 0, "worker0": 0, "worker1": 0}, project.all_logs()
    server_log = project.logs(server)  # both lives of the container
    restored = [line for line in server_log.splitlines() if "restored version" in line]
    assert len(restored) == 1, server_log[-4000:]
    version = int(restored[0].split("restored version ")[1].split()[0])
    # The newest checkpoint at the kill, or one written between the status call and the kill.
    assert before["last_checkpoint_version"] <= version <= before["version"] + 60, (restored, before)
    assert after["version"] >= version
    for index in (0, 1):
        log = project.logs(project.worker_container(index, before))
        assert "the server restarted" in log and f"at version {version}" in log, log[-3000:]
    metrics = _metrics(project)
    assert metrics["version"] == metrics["steps"], metrics  # the lost rounds were trained again
    assert metrics["test_accuracy"] >= 0.90, metrics


# ~40 s: slow. The same rule on a cut link stays in the default run twice: through a proxy
# (tests/chaos/test_worker_faults.py) and between emulated hosts (tests/hosts/test_training.py).
@pytest.mark.slow
def test_worker_cut_from_the_network_is_declared_dead_and_rejoins_when_reconnected(compose_project):
    project = compose_project(TFPS_DEAD_WORKER_POLICY="wait", TFPS_LEASE_TIMEOUT=3, TFPS_REPLACEMENT_TIMEOUT=120,
                              TFPS_EPOCHS=LONG_EPOCHS)
    project.up_detached()
    status = project.wait_for(lambda s: s["version"] >= 20, RUN_TIMEOUT, "20 sync rounds")
    victim = project.worker_container(1, status)
    network = project.network("tfps")
    from tests.docker.conftest import run

    run(["docker", "network", "disconnect", network, victim])
    try:
        cut = project.wait_for(lambda s: any(w["id"] == 1 and w["dead"] for w in s["workers"]), 60,
                               "worker 1 declared dead")
        stalled = cut["version"]
        # Policy wait: the round waits for worker 1's index; nothing is applied meanwhile.
        assert project.status()["version"] <= stalled + 1
    finally:
        run(["docker", "network", "connect", network, victim])
    codes = _exit_codes(project, project.wait_exited(RUN_TIMEOUT))
    assert codes == {"server": 0, "worker0": 0, "worker1": 0}, project.all_logs()
    server_log = project.logs(project.server())
    assert "worker(s) 1" in server_log and "declared dead" in server_log
    assert server_log.count("worker 1 registered") >= 2, server_log[-4000:]  # it came back
    metrics = _metrics(project)
    assert metrics["version"] == metrics["steps"], metrics
    assert metrics["test_accuracy"] >= 0.90, metrics


@pytest.mark.slow  # shards are trained in the default tier by tests/cluster/test_shards.py
def test_two_server_shards_train_digits_to_90_percent(compose_project):
    project = compose_project(files=("compose.yaml", "compose.shards.yaml"))
    project.compose("up", "--no-build", "--no-color", timeout=RUN_TIMEOUT)
    codes = project.wait_exited(30)
    assert set(codes.values()) == {0} and len(codes) == 4, project.all_logs()
    metrics = _metrics(project)
    assert metrics["test_accuracy"] >= 0.90, metrics
    for service in ("server", "server-1"):
        log = project.logs(project.server(service))
        assert "every worker is done (finished: [0, 1]" in log, log[-3000:]


def test_compose_files_are_valid_and_the_gpu_variant_reserves_nvidia_devices(docker_engine, tmp_path):
    from tests.docker.conftest import Compose, Images

    images = Images("python:3.11-slim", {})
    plain = Compose(images).compose("config").stdout
    assert "scale: 2" in plain and "TFPS_WORKER_INDEX: auto" in plain
    assert "condition: service_healthy" in plain
    gpu = Compose(images, ("compose.yaml", "compose.gpu.yaml")).compose("config").stdout
    assert "driver: nvidia" in gpu and "- gpu" in gpu and "TF_EXTRA: gpu" in gpu, gpu
    shards = Compose(images, ("compose.yaml", "compose.shards.yaml")).compose("config").stdout
    assert "TFPS_PS: server:50051,server-1:50051" in shards, shards
    scaled = Compose(images, TFPS_NUM_WORKERS=4).compose("config").stdout
    assert "scale: 4" in scaled and "TFPS_NUM_WORKERS: '4'" in scaled
