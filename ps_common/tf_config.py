"""Read ``TF_CONFIG``, the cluster description TensorFlow users already set.

    spec = parse_tf_config(os.environ.get("TF_CONFIG"))
    spec.ps_addresses, spec.num_workers, spec.task_type, spec.task_index

Example, a Kubeflow TFJob with two PS replicas: ``{"cluster": {"ps": ["ps0:2222",
"ps1:2222"], "chief": ["c0:2222"], "worker": ["w0:2222"]}, "task": {"type":
"worker", "index": 0}}``. A ``chief`` task counts as a worker (it trains, as in
MultiWorkerMirroredStrategy) and is worker 0. Every ``cluster.ps`` entry is a
server shard, in that order (``ps_common.settings`` turns this into fields).
A description that cannot be read raises ``TFConfigError``, a ``ConfigError``
like any other bad setting. Plain Python: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json

from ps_common.errors import ConfigError


class TFConfigError(ConfigError):
    """``TF_CONFIG`` is not a cluster description tfps can use; the message says why."""


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    ps_addresses: tuple[str, ...]
    worker_addresses: tuple[str, ...]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        return len(self.worker_addresses)


def port_of(address: str, where: str) -> int:
    """The port of ``HOST:PORT`` found at ``where`` (e.g. "cluster.ps[1]") in TF_CONFIG."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 0 <= int(port) <= 65535):
        raise TFConfigError(f"TF_CONFIG {where} must be HOST:PORT, got {address!r}")
    return int(port)


def parse_tf_config(raw: str | None) -> ClusterSpec | None:
    if not raw or not raw.strip():
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TFConfigError(f"TF_CONFIG is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise TFConfigError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    cluster = doc.get("cluster") or {}
    task = doc.get("task") or {}
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise TFConfigError("TF_CONFIG 'cluster' and 'task' must be JSON objects")
    for key in ("ps", "worker", "chief"):
        entries = cluster.get(key, [])
        if not isinstance(entries, list):
            raise TFConfigError(f"TF_CONFIG cluster.{key} must be a list of host:port")
        for i, entry in enumerate(entries):
            port_of(entry if isinstance(entry, str) else repr(entry), f"cluster.{key}[{i}]")
    workers = tuple(cluster.get("chief", [])) + tuple(cluster.get("worker", []))
    task_type = str(task.get("type", ""))
    try:
        index = int(task.get("index", 0))
    except (TypeError, ValueError):
        raise TFConfigError(f"TF_CONFIG task.index must be an integer, got {task.get('index')!r}") from None
    if index < 0:
        raise TFConfigError(f"TF_CONFIG task.index must be >= 0, got {index}")
    if task_type == "worker" and cluster.get("chief"):
        index += len(cluster["chief"])  # chief is worker 0
    return ClusterSpec(tuple(cluster.get("ps", [])), workers, task_type, index)
