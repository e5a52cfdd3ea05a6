"""What every replica of a Kubernetes manifest would run with: its TF_CONFIG, environment, command line and names.

    from ps_tools import kube
    for r in kube.replicas("deploy/kubernetes/tfjob.yaml", namespace="default"):
        r.role, r.index       # "ps" 0, "ps" 1, "chief" 0, "worker" 0, "worker" 1
        r.hostname            # "tfps-ps-0.default.svc": the name the other replicas use for it
        r.names               # every name that resolves to it (for a hosts file)
        r.env["TF_CONFIG"]    # the JSON the training-operator writes, byte for byte
        r.process_argv        # ["ps-server"]: what the image's entrypoint runs
        subprocess.run(r.process_argv, env={**os.environ, **r.env})

No cluster needed: this reads the YAML (PyYAML, from the ``test`` extra) and does what
Kubernetes and the operator would do to it, for ``deploy/kubernetes/``:

- **TFJob** (``kubeflow.org/v1``, Kubeflow's training-operator v1.9,
  ``pkg/controller.v1/tensorflow/tensorflow.go``): every replica of type T and index i
  is the pod and headless Service ``<job>-<t>-<i>`` (``t`` = T in lower case), reached as
  ``<job>-<t>-<i>.<namespace>.svc`` (with ``.<domain>`` appended when the operator has
  ``CUSTOM_CLUSTER_DOMAIN``), on the port of the container ``tensorflow``'s port named
  ``tfjob-port`` (2222 when it has none). ``TF_CONFIG`` is
  ``{"cluster":{"<t>":["HOST:PORT",...],...},"task":{"type":"<t>","index":i},"environment":"cloud"}``
  (Go's ``json.Marshal``: compact, map keys sorted), appended to the ``tensorflow``
  container's env; a job of one replica in all gets none (``isDistributed``).
- **plain** objects: a StatefulSet's pod i is ``<name>-<i>``, reached as
  ``<name>-<i>.<serviceName>``; an Indexed Job's pod is ``<name>-<i>`` (its hostname) with
  ``JOB_COMPLETION_INDEX=i``, reached as ``<name>-<i>.<subdomain>`` when it has a subdomain;
  a NonIndexed Job without ``completions`` (a work queue, the elastic workers) has
  ``parallelism`` pods, named ``<name>-x0000``, ... here for their random names.
  Their role is the program their image runs: ``ps`` for ``tfps-server``, ``worker`` for
  ``tfps-worker``.

For each container, the environment is built as the kubelet builds it: the image's own
``TFPS_*`` (``IMAGE_ENV``, as docker/Dockerfile sets them), then ``envFrom`` ConfigMaps
(from the same files), then ``env`` in order, ``$(VAR)`` references expanded, ``fieldRef``
resolved (``metadata.name``, ``metadata.namespace``, labels, the completion-index annotation);
anything else (Secrets, resource fields, ``status.*``) raises ``ValueError``. ``argv`` is
``command`` (else the image's ``ENTRYPOINT``, ``IMAGE_ENTRYPOINT``) plus ``args``, expanded the
same way; ``process_argv`` is what ``tfps-entrypoint`` (docker/entrypoint.sh) then executes.

Plain Python and PyYAML; no Kubernetes client, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Iterable, Mapping

# The images of docker/Dockerfile, by repository name (a registry prefix and the tag are
# ignored): their ENTRYPOINT, and the TFPS_* variables their ENV sets.
IMAGE_ENTRYPOINT = {
    "tfps-server": ("tfps-entrypoint", "ps-server"),
    "tfps-worker": ("tfps-entrypoint", "ps-worker"),
}
IMAGE_ENV = {
    "tfps-server": {"TFPS_HOST": "0.0.0.0", "TFPS_PORT": "50051"},
    "tfps-worker": {},
}
IMAGE_ROLE = {"tfps-server": "ps", "tfps-worker": "worker"}

# The training-operator's constants (pkg/apis/kubeflow.org/v1/tensorflow_types.go).
TFJOB_CONTAINER = "tensorflow"
TFJOB_PORT_NAME = "tfjob-port"
TFJOB_DEFAULT_PORT = 2222
# The order in which replicas are listed here (the operator's map has none).
TFJOB_TYPES = ("PS", "Chief", "Master", "Worker", "Evaluator")
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


@dataclasses.dataclass(frozen=True)
class Replica:
    """One pod of a manifest, as it would run."""

    role: str  # TFJob: the TF_CONFIG task type (ps, chief, worker); plain: ps or worker
    index: int  # TFJob: the task index; plain: the StatefulSet ordinal or the Job completion index
    pod_name: str  # also the pod's own host name: tfps-ps-0
    hostname: str  # the name the other replicas reach it by: tfps-ps-0.default.svc, tfps-ps-0.tfps-ps
    port: int  # TFJob: its tfjob-port (in TF_CONFIG); plain: its first container port, or 0
    image: str
    container: str
    argv: tuple[str, ...]  # the container's command line: entrypoint (or command) + args
    env: dict[str, str]  # the container's environment as the kubelet sets it, TF_CONFIG included
    names: tuple[str, ...] = ()  # every DNS name of it in the cluster: hostname first, then the FQDN, then the pod name
    kind: str = ""  # TFJob, StatefulSet, Job

    @property
    def address(self) -> str:
        return f"{self.hostname}:{self.port}"

    @property
    def process_argv(self) -> list[str]:
        """What runs in the end: ``tfps-entrypoint PROGRAM [ARG...]`` execs PROGRAM with the
        arguments when there are none or the first one is a flag, the arguments otherwise."""
        argv = list(self.argv)
        if argv[:1] == ["tfps-entrypoint"] and len(argv) >= 2:
            program, rest = argv[1], argv[2:]
            return [program, *rest] if not rest or rest[0].startswith("-") else rest
        return argv

    @property
    def tf_config(self) -> dict | None:
        raw = self.env.get("TF_CONFIG")
        return json.loads(raw) if raw else None


def load(paths: str | pathlib.Path | Iterable[str | pathlib.Path]) -> list[dict]:
    """Every object of the YAML files ``paths`` (a file, a folder's *.yaml and *.yml like
    ``kubectl apply -f DIR``, not recursive, or several of those), in order."""
    import yaml

    if isinstance(paths, (str, pathlib.Path)):
        paths = [paths]
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        files += sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml")) if p.is_dir() else [p]
    docs = []
    for f in files:
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
    return docs


def replicas(paths, job_name: str | None = None, namespace: str = "default",
             custom_cluster_domain: str = "", cluster_domain: str = "cluster.local") -> list[Replica]:
    """Every replica the manifests ``paths`` start (see ``load``): a TFJob's PS, Chief, Worker
    replicas, a StatefulSet's and an Indexed Job's pods, a work-queue Job's ``parallelism``
    pods, in the files' order (a TFJob's by type: PS, Chief, Worker). ``job_name`` deploys a
    TFJob under another name; ``namespace`` is where objects go whose metadata names none
    (``kubectl apply -n``); ``custom_cluster_domain`` is the operator's ``CUSTOM_CLUSTER_DOMAIN``; ``cluster_domain``
    the cluster's DNS domain, for the fully qualified names in ``Replica.names``.

    To run a replica on an emulated host: give it an address, write ``hosts_file`` for
    every host, and start ``process_argv`` (``ps-server``, ``ps-worker``: the project's
    console scripts, on PATH in its venv) with ``{**os.environ, **env}``."""
    docs = load(paths)
    config_maps = {d["metadata"]["name"]: d.get("data") or {} for d in docs if d.get("kind") == "ConfigMap"}
    out: list[Replica] = []
    for doc in docs:
        kind = doc.get("kind")
        if kind == "TFJob":
            out += tfjob_replicas(doc, config_maps, job_name, namespace, custom_cluster_domain, cluster_domain)
        elif kind == "StatefulSet":
            out += _statefulset_replicas(doc, config_maps, namespace, cluster_domain)
        elif kind == "Job":
            out += _job_replicas(doc, config_maps, namespace, cluster_domain)
    if job_name is not None and not any(d.get("kind") == "TFJob" for d in docs):
        raise ValueError("job_name renames a TFJob; these manifests have none")
    return out


# -- TFJob ------------------------------------------------------------------------------
def _replica_specs(doc: dict) -> dict[str, dict]:
    """The TFJob's replica specs under their canonical type names (the operator's defaulting
    turns "ps" or "worker" into "PS", "Worker"), in TFJOB_TYPES order."""
    specs = {}
    given = doc["spec"]["tfReplicaSpecs"]
    for key, spec in given.items():
        canonical = next((t for t in TFJOB_TYPES if t.lower() == key.lower()), None)
        if canonical is None:
            raise ValueError(f"TFJob replica type {key!r} is none of {', '.join(TFJOB_TYPES)}")
        specs[canonical] = spec
    return {t: specs[t] for t in TFJOB_TYPES if t in specs}


def tfjob_port(spec: dict) -> int:
    """GetPortFromTFJob: the tensorflow container's port named tfjob-port, else 2222."""
    for c in spec["template"]["spec"]["containers"]:
        if c["name"] == TFJOB_CONTAINER:
            for p in c.get("ports") or []:
                if p.get("name") == TFJOB_PORT_NAME:
                    return int(p["containerPort"])
    return TFJOB_DEFAULT_PORT


def tfjob_cluster(doc: dict, job_name: str | None = None, namespace: str = "default",
                  custom_cluster_domain: str = "") -> dict[str, list[str]]:
    """genClusterSpec: {task type: ["<job>-<type>-<i>.<namespace>.svc[.<domain>]:<port>", ...]}."""
    name = job_name or doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace") or namespace
    cluster = {}
    for rtype, spec in _replica_specs(doc).items():
        rt = rtype.lower()
        port = tfjob_port(spec)
        entries = []
        for i in range(int(spec.get("replicas", 1))):
            host = f"{name}-{rt}-{i}".replace("/", "-") + f".{namespace}.svc"
            if custom_cluster_domain:
                host += "." + custom_cluster_domain
            entries.append(f"{host}:{port}")
        cluster[rt] = entries
    return cluster


def tf_config_json(cluster: Mapping[str, list[str]], task_type: str, index: int) -> str:
    """genTFConfigJSONStr, as Go's json.Marshal writes it: compact, the cluster's keys sorted."""
    doc = {"cluster": {k: list(cluster[k]) for k in sorted(cluster)},
           "task": {"type": task_type, "index": index}, "environment": "cloud"}
    return json.dumps(doc, separators=(",", ":"))


def tfjob_replicas(doc: dict, config_maps: Mapping[str, Mapping[str, str]] | None = None,
                   job_name: str | None = None, namespace: str = "default", custom_cluster_domain: str = "",
                   cluster_domain: str = "cluster.local") -> list[Replica]:
    """The replicas of one TFJob object (see ``replicas``)."""
    config_maps = config_maps or {}
    name = job_name or doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace") or namespace
    specs = _replica_specs(doc)
    cluster = tfjob_cluster(doc, job_name, namespace, custom_cluster_domain)
    distributed = sum(int(s.get("replicas", 1)) for s in specs.values()) != 1
    out = []
    for rtype, spec in specs.items():
        rt = rtype.lower()
        pod_spec = spec["template"]["spec"]
        container = _container(pod_spec, TFJOB_CONTAINER)
        for i in range(int(spec.get("replicas", 1))):
            pod_name = f"{name}-{rt}-{i}".replace("/", "-")
            pod_meta = {"name": pod_name, "namespace": namespace,
                        "labels": {**(spec["template"].get("metadata") or {}).get("labels", {}),
                                   "training.kubeflow.org/job-name": name,
                                   "training.kubeflow.org/replica-type": rt,
                                   "training.kubeflow.org/replica-index": str(i)},
                        "annotations": dict((spec["template"].get("metadata") or {}).get("annotations", {}))}
            extra = {"TF_CONFIG": tf_config_json(cluster, rt, i)} if distributed else {}
            env, argv = container_env_argv(container, pod_meta, config_maps, extra)
            hostname, _, port = cluster[rt][i].rpartition(":")
            fqdn = f"{pod_name}.{namespace}.svc.{custom_cluster_domain or cluster_domain}"
            out.append(Replica(rt, i, pod_name, hostname, int(port), container["image"], container["name"],
                               tuple(argv), env, _unique((hostname, fqdn, f"{pod_name}.{namespace}", pod_name)),
                               "TFJob"))
    return out


# -- plain objects ------------------------------------------------------------------------
def _statefulset_replicas(doc, config_maps, namespace, cluster_domain) -> list[Replica]:
    name = doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace") or namespace
    spec = doc["spec"]
    service = spec["serviceName"]
    out = []
    for i in range(int(spec.get("replicas", 1))):
        pod_name = f"{name}-{i}"
        labels = {**(spec["template"].get("metadata") or {}).get("labels", {}),
                  "statefulset.kubernetes.io/pod-name": pod_name, "apps.kubernetes.io/pod-index": str(i)}
        meta = {"name": pod_name, "namespace": namespace, "labels": labels,
                "annotations": dict((spec["template"].get("metadata") or {}).get("annotations", {}))}
        out.append(_plain_replica(doc, spec["template"]["spec"], meta, i, f"{pod_name}.{service}", service,
                                  config_maps, namespace, cluster_domain, {}))
    return out


def _job_replicas(doc, config_maps, namespace, cluster_domain) -> list[Replica]:
    name = doc["metadata"]["name"]
    namespace = doc["metadata"].get("namespace") or namespace
    spec = doc["spec"]
    if spec.get("completionMode", "NonIndexed") == "NonIndexed":
        return _work_queue_replicas(doc, config_maps, namespace, cluster_domain)
    if spec.get("completionMode") != "Indexed":
        raise ValueError(f"Job {name}: completionMode {spec['completionMode']!r} is neither Indexed nor NonIndexed")
    pod_spec = spec["template"]["spec"]
    subdomain = pod_spec.get("subdomain")
    out = []
    for i in range(int(spec.get("completions", 1))):
        host = f"{name}-{i}"  # the Job controller's pod hostname; the pod name has a random suffix
        meta = {"name": f"{host}-xxxxx", "namespace": namespace,
                "labels": {**(spec["template"].get("metadata") or {}).get("labels", {}),
                           "batch.kubernetes.io/job-name": name, "batch.kubernetes.io/job-completion-index": str(i)},
                "annotations": {**(spec["template"].get("metadata") or {}).get("annotations", {}),
                                COMPLETION_INDEX_ANNOTATION: str(i)}}
        out.append(_plain_replica(doc, pod_spec, meta, i, f"{host}.{subdomain}" if subdomain else host,
                                  subdomain, config_maps, namespace, cluster_domain,
                                  {"JOB_COMPLETION_INDEX": str(i)}, pod_name=host))
    return out


def _work_queue_replicas(doc, config_maps, namespace, cluster_domain) -> list[Replica]:
    """A NonIndexed Job without ``completions`` (a work queue: complete once a pod succeeded and
    every pod ended): ``parallelism`` pods at a time. Their names carry a random suffix, written
    here ``<name>-x0000``, ``<name>-x0001``, ...; the index is their place in that list, which
    the pods themselves never see."""
    name = doc["metadata"]["name"]
    spec = doc["spec"]
    if "completions" in spec:
        raise ValueError(f"Job {name}: a NonIndexed Job is read as a work queue, which sets no completions")
    out = []
    for i in range(int(spec.get("parallelism", 1))):
        pod_name = f"{name}-x{i:04d}"
        meta = {"name": pod_name, "namespace": namespace,
                "labels": {**(spec["template"].get("metadata") or {}).get("labels", {}),
                           "batch.kubernetes.io/job-name": name},
                "annotations": dict((spec["template"].get("metadata") or {}).get("annotations", {}))}
        out.append(_plain_replica(doc, spec["template"]["spec"], meta, i, pod_name, None, config_maps, namespace,
                                  cluster_domain, {}))
    return out


def _plain_replica(doc, pod_spec, meta, index, hostname, service, config_maps, namespace, cluster_domain,
                   first_env, pod_name=None) -> Replica:
    if len(pod_spec["containers"]) != 1:
        raise ValueError(f"{doc['kind']} {doc['metadata']['name']}: one container per pod expected")
    container = pod_spec["containers"][0]
    role = IMAGE_ROLE.get(image_repository(container["image"]))
    if role is None:
        raise ValueError(f"{doc['kind']} {doc['metadata']['name']}: image {container['image']!r} is no tfps image "
                         f"({', '.join(IMAGE_ROLE)})")
    env, argv = container_env_argv(container, meta, config_maps, {}, first_env)
    ports = container.get("ports") or []
    pod_name = pod_name or meta["name"]
    names = [hostname]
    if service:
        names += [f"{hostname}.{namespace}.svc.{cluster_domain}", f"{hostname}.{namespace}.svc",
                  f"{hostname}.{namespace}"]
    names.append(pod_name)
    return Replica(role, index, pod_name, hostname, int(ports[0]["containerPort"]) if ports else 0,
                   container["image"], container["name"], tuple(argv), env, _unique(names), doc["kind"])


# -- containers ---------------------------------------------------------------------------
def image_repository(image: str) -> str:
    """``registry.example.com:5000/team/tfps-server:0.1@sha256:...`` -> ``tfps-server``."""
    image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def _container(pod_spec: dict, name: str) -> dict:
    for c in pod_spec["containers"]:
        if c["name"] == name:
            return c
    raise ValueError(f"no container named {name!r} (the TFJob operator sets TF_CONFIG in that one only)")


_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, an undefined
    reference stays as written, ``$$`` is one ``$``."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, text)


def _field(path: str, meta: Mapping) -> str:
    if path == "metadata.name":
        return meta["name"]
    if path == "metadata.namespace":
        return meta["namespace"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m and m.group(2) in meta.get(m.group(1), {}):
        return meta[m.group(1)][m.group(2)]
    raise ValueError(f"fieldRef {path!r} cannot be resolved offline")


def container_env_argv(container: dict, pod_meta: Mapping, config_maps: Mapping[str, Mapping[str, str]],
                       extra: Mapping[str, str] | None = None,
                       first: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The container's environment and command line: the image's TFPS_* variables, then
    ``first`` (what a controller sets before the pod's own, e.g. JOB_COMPLETION_INDEX), the
    ``envFrom`` ConfigMaps, ``env``, then ``extra`` (what the TFJob operator appends)."""
    repo = image_repository(container["image"])
    env: dict[str, str] = dict(IMAGE_ENV.get(repo, {}))
    env.update(first or {})
    for source in container.get("envFrom") or []:
        if "configMapRef" not in source:
            raise ValueError(f"envFrom {source!r}: only configMapRef can be resolved offline")
        ref = source["configMapRef"]
        if ref["name"] not in config_maps:
            if ref.get("optional"):
                continue
            raise ValueError(f"envFrom: no ConfigMap {ref['name']!r} in these manifests")
        prefix = source.get("prefix", "")
        env.update({prefix + k: str(v) for k, v in config_maps[ref["name"]].items()})
    for var in container.get("env") or []:
        if "value" in var or "valueFrom" not in var:
            env[var["name"]] = expand(str(var.get("value", "")), env)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = _field(source["fieldRef"]["fieldPath"], pod_meta)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = str(config_maps[ref["name"]][ref["key"]])
        else:
            raise ValueError(f"env {var['name']}: {sorted(source)} cannot be resolved offline")
    env.update(extra or {})
    command = container.get("command")
    if command is None:
        if repo not in IMAGE_ENTRYPOINT:
            raise ValueError(f"image {container['image']!r}: no command and no known ENTRYPOINT")
        command = list(IMAGE_ENTRYPOINT[repo])
    argv = [expand(str(a), env) for a in command] + [expand(str(a), env) for a in container.get("args") or []]
    return env, argv


def _unique(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for n in names if n))


def hosts_file(reps: Iterable[Replica], addresses: Mapping[str, str]) -> str:
    """An /etc/hosts text giving every replica's names the address ``addresses[pod_name]``."""
    return "".join(f"{addresses[r.pod_name]}\t{' '.join(r.names)}\n" for r in reps)
