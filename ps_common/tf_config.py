"""Read ``TF_CONFIG``, the cluster description TensorFlow users already set.

    spec = parse_tf_config(os.environ.get("TF_CONFIG"))
    spec.ps_addresses, spec.num_workers, spec.task_type, spec.task_index

Example: ``{"cluster": {"ps": ["ps0:2222"], "worker": ["w0:2222", "w1:2222"]},
"task": {"type": "worker", "index": 1}}``. A ``chief`` task counts as a worker
(it trains, as in MultiWorkerMirroredStrategy). Plain Python: no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json


class TFConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    ps_addresses: tuple[str, ...]
    worker_addresses: tuple[str, ...]
    task_type: str
    task_index: int

    @property
    def num_workers(self) -> int:
        return len(self.worker_addresses)


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
        if not isinstance(cluster.get(key, []), list):
            raise TFConfigError(f"TF_CONFIG cluster.{key} must be a list of host:port")
    workers = tuple(cluster.get("chief", [])) + tuple(cluster.get("worker", []))
    task_type = str(task.get("type", ""))
    try:
        index = int(task.get("index", 0))
    except (TypeError, ValueError):
        raise TFConfigError(f"TF_CONFIG task.index must be an integer, got {task.get('index')!r}") from None
    if task_type == "worker" and cluster.get("chief"):
        index += len(cluster["chief"])  # chief is worker 0
    return ClusterSpec(tuple(cluster.get("ps", [])), workers, task_type, index)
