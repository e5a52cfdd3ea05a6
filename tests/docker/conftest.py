"""The container tier: real images, real `docker-compose` runs, real kills.

Tests marked ``docker`` build the images once per session (the base image with
docker/build-base.sh, as on a machine without a registry, unless
TFPS_DOCKER_BASE_IMAGE names one to use, e.g. python:3.11-slim): the build starts
on a thread as soon as the run's tests are collected, when they hold one of this
tier and the engine answers, so that its minutes of pip and the engine pass while
the other tiers run, throttled to half a core beside them (a build still under way
when the run ends is stopped). Then they run
docker/compose.yaml under a project name of their own (``tfpstest<pid>x<n>``),
so they never touch a user's `tfps` project. Every project is taken down with
``down -v`` when its test ends, pass or fail, and leftovers of an earlier run
that was killed are removed when the session starts.

The tier runs in the default test command on a machine with the ``docker``
command; on one without, it is skipped and says so. A Docker engine that does
not answer is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent import futures

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKER_DIR = os.path.join(ROOT, "docker")
PREFIX = "tfpstest"
SERVER_IMAGE = "tfps-server:test"
WORKER_IMAGE = "tfps-worker:test"
BUILD_TIMEOUT = 1200

# Asked inside the server container (its image has the package, without TensorFlow).
STATUS_SCRIPT = """
import json
from worker.client import PSClient
with PSClient("127.0.0.1:50051", timeout=5) as c:
    s = c.status()
print(json.dumps({"version": s.version, "round": s.round, "initialized": s.initialized,
                  "last_checkpoint_version": s.last_checkpoint_version,
                  "incarnation": s.incarnation, "active": list(s.active_workers),
                  "examples_applied": s.examples_applied,
                  "workers": [{"id": w.worker_id, "name": w.worker_name, "left": w.left, "dead": w.dead,
                               "last_step": w.last_step, "pushes": w.pushes} for w in s.workers]}))
"""


def run(argv: list[str], timeout: float = 120, check: bool = True, env: dict | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, input=input,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout} s; output so far:\n"
                             f"{(e.stdout or b'')[-2000:]!r}\n{(e.stderr or b'')[-2000:]!r}") from None
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _remove_leftovers() -> None:
    """Containers, networks and volumes of test projects an interrupted run left behind."""
    ids = run(["docker", "ps", "-a", "-q", "--filter", "label=com.docker.compose.project"], check=False).stdout.split()
    for cid in ids:
        project = run(["docker", "inspect", "-f", '{{index .Config.Labels "com.docker.compose.project"}}', cid],
                      check=False).stdout.strip()
        if project.startswith(PREFIX):
            run(["docker", "rm", "-f", "-v", cid], check=False)
    for kind in ("network", "volume"):
        names = run(["docker", kind, "ls", "-q", "--filter", f"name={PREFIX}"], check=False).stdout.split()
        for name in names:
            run(["docker", kind, "rm", name], check=False)


@pytest.fixture(scope="session")
def docker_engine() -> str:
    if shutil.which("docker") is None:
        pytest.skip("no docker command on this machine: the container tier needs a Docker engine")
    info = run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, timeout=60)
    if info.returncode != 0:
        pytest.fail(f"the docker command is here but the engine does not answer: {info.stderr.strip()}")
    if shutil.which("docker-compose") is None:
        pytest.fail("the container tier runs docker/compose.yaml with docker-compose, which is not installed")
    _remove_leftovers()
    return info.stdout.strip()


class Images:
    def __init__(self, base: str, seconds: dict[str, float]):
        self.base, self.seconds = base, seconds
        self.server, self.worker = SERVER_IMAGE, WORKER_IMAGE


# A build beside other tests takes at most half a core (a CFS quota on each of the classic
# builder's RUN steps; debootstrap at the lowest priority), so that it leaves the tests it runs
# beside most of the machine; it has the minutes until the docker tier starts.
BACKGROUND_CPU_QUOTA_US = 50_000  # of every 100,000 us


def _build_images(beside: bool) -> Images:
    """The base image (docker/build-base.sh, or TFPS_DOCKER_BASE_IMAGE) and both images
    built from docker/Dockerfile, as docs/docker.md says, with the seconds each took;
    ``beside`` other tests: throttled."""
    seconds = {}
    t0 = time.monotonic()
    base = os.environ.get("TFPS_DOCKER_BASE_IMAGE")
    if not base:
        nice = ["nice", "-n", "19"] if beside else []
        base = _build_step([*nice, "bash", os.path.join(DOCKER_DIR, "build-base.sh")]).strip().splitlines()[-1]
    seconds["base"] = time.monotonic() - t0
    quota = ["--cpu-period", "100000", "--cpu-quota", str(BACKGROUND_CPU_QUOTA_US)] if beside else []
    for target, tag in (("server", SERVER_IMAGE), ("worker", WORKER_IMAGE)):
        t0 = time.monotonic()
        _build_step(["docker", "build", "-q", *quota, "-f", "docker/Dockerfile", "--target", target,
                     "--build-arg", f"BASE_IMAGE={base}", "-t", tag, "."])
        seconds[target] = time.monotonic() - t0
    return Images(base, seconds)


class _Build:
    """The one build of a run (``_build_images`` on a thread), and the command it runs now,
    which ``stop`` ends."""

    future: futures.Future | None = None
    running: subprocess.Popen | None = None
    stopped = False
    lock = threading.Lock()


def _build_step(argv: list[str]) -> str:
    """``argv``'s standard output; AssertionError if it fails, outlasts BUILD_TIMEOUT or the run ends."""
    with _Build.lock:
        if _Build.stopped:
            raise AssertionError("the test run ended before the images were built")
        proc = _Build.running = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                 cwd=ROOT, start_new_session=True)  # killed with its children
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish within {BUILD_TIMEOUT} s:\n{err[-3000:]}") from None
    finally:
        _Build.running = None
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}")
    return out


def _start_build(beside: bool = False) -> futures.Future:
    if _Build.future is None:
        pool = futures.ThreadPoolExecutor(1, thread_name_prefix="tfps-image-build")
        _Build.future = pool.submit(_build_images, beside)
        pool.shutdown(wait=False)
    return _Build.future


def pytest_collection_finish(session) -> None:
    """Start the build now when a test of this tier will run and the engine answers (else the
    ``docker_engine`` fixture says why, skipping or failing), throttled when other tests will
    run beside it."""
    docker = [bool(item.get_closest_marker("docker")) for item in session.items]
    if any(docker) and shutil.which("docker") and shutil.which("docker-compose") \
            and run(["docker", "info"], check=False, timeout=60).returncode == 0:
        _start_build(beside=not all(docker))


def pytest_sessionfinish(session) -> None:
    """A build still under way (every docker test deselected by a failure, ``-x``) stops here."""
    with _Build.lock:
        _Build.stopped, proc = True, _Build.running
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def images(docker_engine) -> Images:
    """The images of this run (``_build_images``), its build started at collection's end or now;
    the times go to the test report."""
    built = _start_build().result()
    print(f"\ncontainer images built: base {built.base} {built.seconds['base']:.0f} s, server "
          f"{built.seconds['server']:.0f} s, worker {built.seconds['worker']:.0f} s")
    return built


class Compose:
    """One docker-compose project of docker/compose.yaml (plus override files)."""

    _count = 0

    def __init__(self, images: Images, files: tuple[str, ...] = ("compose.yaml",), **settings: str):
        Compose._count += 1
        self.name = f"{PREFIX}{os.getpid()}x{Compose._count}"
        self.images = images
        self.files = [os.path.join(DOCKER_DIR, f) for f in files]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TFPS_")}
        env.update(BASE_IMAGE=images.base, TFPS_SERVER_IMAGE=images.server, TFPS_WORKER_IMAGE=images.worker)
        env.update({k: str(v) for k, v in settings.items()})
        self.env = env

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        argv = ["docker-compose", "-p", self.name]
        for f in self.files:
            argv += ["-f", f]
        return run(argv + list(args), timeout=timeout, check=check, env=self.env)

    def up_detached(self) -> None:
        self.compose("up", "-d", "--no-build", timeout=300)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=180, check=False)

    # -- containers -----------------------------------------------------------------
    def containers(self, service: str) -> list[str]:
        out = run(["docker", "ps", "-a", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.name}",
                   "--filter", f"label=com.docker.compose.service={service}"]).stdout
        return sorted(out.split())

    def server(self, service: str = "server") -> str:
        (cid,) = self.containers(service)
        return cid

    def state(self, cid: str) -> dict:
        return json.loads(run(["docker", "inspect", "-f", "{{json .State}}", cid]).stdout)

    def logs(self, cid: str) -> str:
        out = run(["docker", "logs", cid], check=False)
        return out.stdout + out.stderr

    def all_logs(self) -> str:
        return self.compose("logs", "--no-color", check=False, timeout=60).stdout[-12000:]

    def wait_exited(self, timeout: float) -> dict[str, int]:
        """Every container of the project stopped: {container id: exit code}."""
        deadline = time.monotonic() + timeout
        ids = [c for s in self.services() for c in self.containers(s)]
        while True:
            states = {c: self.state(c) for c in ids}
            if not any(s["Running"] for s in states.values()):
                return {c: s["ExitCode"] for c, s in states.items()}
            if time.monotonic() > deadline:
                running = [c[:12] for c, s in states.items() if s["Running"]]
                raise AssertionError(f"containers {running} still run after {timeout} s\n{self.all_logs()}")
            time.sleep(1.0)

    def services(self) -> list[str]:
        return self.compose("config", "--services").stdout.split()

    def volume(self, name: str) -> str:
        return f"{self.name}_{name}"  # compose's name of the project's volume `name`

    network = volume  # networks are named the same way

    def read_file(self, volume: str, path: str) -> str:
        """A file from a named volume, through a throwaway container of the server image."""
        return run(["docker", "run", "--rm", "-v", f"{self.volume(volume)}:/data:ro", "--entrypoint", "cat",
                    self.images.server, path]).stdout

    # -- the cluster, as the server sees it ------------------------------------------
    def status(self, service: str = "server") -> dict | None:
        """The server's Status, or None while it does not answer."""
        done = run(["docker", "exec", "-i", self.server(service), "python", "-"], input=STATUS_SCRIPT, check=False,
                   timeout=60)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def wait_for(self, predicate, timeout: float, what: str, service: str = "server") -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(service)
            if status is not None and predicate(status):
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s (last status {status})\n{self.all_logs()}")
            time.sleep(0.5)

    def worker_container(self, index: int, status: dict) -> str:
        """The container of worker ``index``: its registration name is "<hostname>:<pid>",
        and a container's hostname is its short id."""
        (name,) = [w["name"] for w in status["workers"] if w["id"] == index]
        host = name.split(":")[0]
        (cid,) = [c for c in self.containers("worker") if c.startswith(host)]
        return cid


@pytest.fixture
def compose_project(images, request):
    """``compose_project(files=..., **settings) -> Compose``; every project is taken down
    (``down -v``) when the test ends, with its logs printed when the test failed."""
    made: list[Compose] = []

    def make(files: tuple[str, ...] = ("compose.yaml",), **settings) -> Compose:
        project = Compose(images, files, **settings)
        made.append(project)
        return project

    yield make
    for project in made:
        if getattr(request.node, "rep_call_failed", False):
            print(f"\n--- logs of {project.name} ---\n{project.all_logs()}")
        project.down()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.rep_call_failed = True
