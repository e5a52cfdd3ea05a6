"""Run TensorFlow's multi-process strategies without exposing ports to the network.

    argv, note = isolated([sys.executable, "-m", "tf_strategies.mwms", ...])
    subprocess.run(dying_with_parent(argv))

TensorFlow's gRPC servers (``tf.distribute.Server``, used by
MultiWorkerMirroredStrategy and ParameterServerStrategy) listen on all
interfaces, with no option to bind loopback only. ``isolated`` wraps a command
so it runs in a private network namespace with only ``lo`` up: the cluster's
processes (all started by that command) see each other on 127.0.0.1 and
nothing outside can reach them. It needs ``unshare`` and ``ip`` (util-linux,
iproute2) and root or unprivileged user namespaces; without them the command
runs as is and ``note`` says so. ``TFPS_NO_NETNS=1`` turns the wrapping off.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from ps_common.ports import free_ports  # noqa: F401  (runners and bench/ import it from here)
from ps_common.procs import die_with_parent, dying_with_parent  # noqa: F401  (runners import them from here)


def _prefix() -> list[str]:
    unshare = shutil.which("unshare")
    ip = shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
    if not unshare or not ip:
        raise OSError("unshare or ip not found (install util-linux and iproute2)")
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return [unshare, "--net", *user, "sh", "-c", f'{ip} link set lo up && exec "$0" "$@"']


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[list[str] | None, str]:
    if os.environ.get("TFPS_NO_NETNS"):
        return None, "not isolated: TFPS_NO_NETNS is set"
    try:
        prefix = _prefix()
        run = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"not isolated ({e}); TensorFlow's servers listen on all interfaces"
    if run.returncode != 0:
        return None, f"not isolated (unshare failed: {run.stderr.strip()}); TensorFlow's servers listen on all interfaces"
    return prefix, "isolated in a private network namespace (loopback only)"


def isolated(argv: list[str]) -> tuple[list[str], str]:
    prefix, note = _probe()
    return ([*prefix, *argv] if prefix else list(argv)), note
