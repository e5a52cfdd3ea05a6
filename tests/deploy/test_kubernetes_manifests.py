"""The Kubernetes manifests of deploy/kubernetes/, checked offline (no cluster runs here).

    .venv/bin/python -m pytest -q tests/deploy

Rules checked:
- every object is a Kubernetes object: each one deserializes into the ``kubernetes``
  client's model of its kind, and a strict walk of the models' ``attribute_map`` and
  ``openapi_types`` refuses any field the API does not have and any value of the wrong
  type (the client itself drops unknown fields without a word; quantities are strings,
  as the models type them); a TFJob is checked against the training-operator's v1 types
  and its admission webhook's rules, its replica templates as ``V1PodTemplateSpec``; the
  names follow the API server's rules;
- the images are those of docker/ under the names docker/compose*.yaml give them, and
  ``ps_tools.kube`` knows their ENTRYPOINT and ENV as docker/Dockerfile sets them;
- every server has startup, readiness and liveness probes on the gRPC health service, at
  the port it listens on; every container requests and limits CPU and memory; the GPU
  variants differ from the CPU files only in the worker image, the GPU and a toleration;
- each replica's TF_CONFIG is the training-operator's, byte for byte, and each replica's
  environment and command line resolve with tfps' own configuration code
  (``ServerConfig``, ``WorkerConfig``, and ``ps-server``/``ps-worker --print-config``
  themselves) to the right role, index, shards and worker count;
- restart policies, checkpoint volumes, names and Services fit together.
Each check is also run on an input it must refuse.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")
client = pytest.importorskip("kubernetes.client")

from ps_common.settings import ConfigError  # noqa: E402
from ps_server.config import ServerConfig  # noqa: E402
from ps_tools import kube  # noqa: E402
from worker.config import AUTO_INDEX, WorkerConfig  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
TFJOB = DEPLOY / "tfjob.yaml"
TFJOB_GPU = DEPLOY / "tfjob-gpu.yaml"
PLAIN = DEPLOY / "plain"
PLAIN_GPU = [PLAIN / "settings.yaml", PLAIN / "ps.yaml", PLAIN / "gpu" / "workers.yaml"]
ELASTIC = DEPLOY / "elastic"
FILES = sorted(DEPLOY.rglob("*.yaml"))
TFJOBS = [TFJOB, TFJOB_GPU]
PLAINS = [PLAIN, PLAIN_GPU]
ALL_SETS = [*TFJOBS, *PLAINS, ELASTIC]


def _id(p) -> str:
    paths = p if isinstance(p, list) else [p]
    return "+".join(q.relative_to(ROOT).as_posix() for q in paths)


# -- the strict check against the API's types ------------------------------------------------
KINDS = {"ConfigMap": "v1", "Service": "v1", "PersistentVolumeClaim": "v1", "StatefulSet": "apps/v1",
         "Job": "batch/v1"}
PRIMITIVES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def model_errors(data, klass: str, path: str = "") -> list[str]:
    """Every field of ``data`` that the client's model ``klass`` (e.g. "V1PodSpec") lacks,
    and every value of the wrong type, recursively; [] for a valid object."""
    m = re.fullmatch(r"(?:List|list)\[(.+)\]", klass)
    if m:
        if not isinstance(data, list):
            return [f"{path}: a list expected, got {type(data).__name__}"]
        return [e for i, item in enumerate(data) for e in model_errors(item, m.group(1), f"{path}[{i}]")]
    m = re.fullmatch(r"(?:Dict\[|dict\()str, (.+)[\])]", klass)
    if m:
        if not isinstance(data, dict):
            return [f"{path}: a map expected, got {type(data).__name__}"]
        return [e for k, v in data.items() for e in model_errors(v, m.group(1), f"{path}.{k}")]
    if klass == "object":
        return []
    if klass in PRIMITIVES:
        ok = isinstance(data, PRIMITIVES[klass]) and not (klass != "bool" and isinstance(data, bool))
        return [] if ok else [f"{path}: {klass} expected, got {data!r}"]
    if klass in ("datetime", "date"):
        return [] if isinstance(data, str) else [f"{path}: a time expected, got {data!r}"]
    model = getattr(client, klass)
    if not isinstance(data, dict):
        return [f"{path}: an object ({klass}) expected, got {data!r}"]
    by_json = {v: k for k, v in model.attribute_map.items()}
    errors = []
    for key, value in data.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: no such field in {klass}")
        else:
            errors += model_errors(value, model.openapi_types[by_json[key]], f"{path}.{key}")
    return errors


def deserialize(data, klass: str):
    """The client's own deserializer (it checks required fields and some enums)."""
    return client.ApiClient()._ApiClient__deserialize(copy.deepcopy(data), klass)


# The TFJob's fields, from the training-operator's Go types (kubeflow.org/v1, v1.9:
# pkg/apis/kubeflow.org/v1/tensorflow_types.go and common_types.go). A str names a client
# model, a tuple lists the allowed values, a dict is a closed object.
REPLICA_SPEC = {"replicas": int, "template": "V1PodTemplateSpec",
                "restartPolicy": ("Always", "OnFailure", "Never", "ExitCode")}
TFJOB_SCHEMA = {
    "apiVersion": ("kubeflow.org/v1",),
    "kind": ("TFJob",),
    "metadata": "V1ObjectMeta",
    "spec": {
        "runPolicy": {"cleanPodPolicy": ("All", "Running", "None"), "ttlSecondsAfterFinished": int,
                      "activeDeadlineSeconds": int, "backoffLimit": int, "suspend": bool, "managedBy": str,
                      "schedulingPolicy": {"minAvailable": int, "queue": str, "minResources": "Dict[str, str]",
                                           "priorityClass": str, "scheduleTimeoutSeconds": int}},
        "successPolicy": ("", "AllWorkers"),
        "tfReplicaSpecs": {t: REPLICA_SPEC for t in kube.TFJOB_TYPES},
        "enableDynamicWorker": bool,
    },
}


def schema_errors(data, schema, path: str = "") -> list[str]:
    if isinstance(schema, str):
        errors = model_errors(data, schema, path)
        if not errors:
            try:
                deserialize(data, schema)
            except (ValueError, TypeError) as e:
                errors.append(f"{path}: {e}")
        return errors
    if isinstance(schema, tuple):
        return [] if data in schema else [f"{path}: one of {schema} expected, got {data!r}"]
    if isinstance(schema, type):
        ok = isinstance(data, schema) and not (schema is int and isinstance(data, bool))
        return [] if ok else [f"{path}: {schema.__name__} expected, got {data!r}"]
    if not isinstance(data, dict):
        return [f"{path}: an object expected, got {data!r}"]
    errors = []
    for key, value in data.items():
        if key not in schema:
            errors.append(f"{path}.{key}: no such field")
        else:
            errors += schema_errors(value, schema[key], f"{path}.{key}")
    return errors


DNS1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
PORT_NAME = re.compile(r"(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*")  # IANA_SVC_NAME


def tfjob_webhook_errors(doc: dict) -> list[str]:
    """The training-operator's admission webhook (v1.9, pkg/webhooks/tensorflow/tfjob_webhook.go):
    a DNS-1035 name, at least one container per replica type, each with an image, one named
    "tensorflow", at most one Chief or Master."""
    errors = []
    if not DNS1035.fullmatch(doc["metadata"].get("name", "")):
        errors.append(f"TFJob name {doc['metadata'].get('name')!r} is not a DNS-1035 label")
    specs = doc.get("spec", {}).get("tfReplicaSpecs") or {}
    if not specs:
        errors.append("TFJob.spec.tfReplicaSpecs: required")
    for rtype, spec in specs.items():
        containers = (spec or {}).get("template", {}).get("spec", {}).get("containers") or []
        if not containers:
            errors.append(f"TFJob {rtype}: containers must be specified")
        if any(not c.get("image") for c in containers):
            errors.append(f"TFJob {rtype}: every container needs an image")
        if not any(c.get("name") == kube.TFJOB_CONTAINER for c in containers):
            errors.append(f"TFJob {rtype}: no container named {kube.TFJOB_CONTAINER}")
    if sum(t.lower() in ("chief", "master") for t in specs) > 1:
        errors.append("TFJob: more than one Chief or Master")
    return errors


def name_errors(doc: dict) -> list[str]:
    """A few of the API server's own rules that the models do not hold: object, container,
    volume and port names."""
    errors = []
    name = doc["metadata"].get("name", "")
    if not (DNS1035 if doc["kind"] == "Service" else DNS1123).fullmatch(name):
        errors.append(f"{doc['kind']} name {name!r} is not a valid name")
    specs = ([s["template"]["spec"] for s in doc["spec"]["tfReplicaSpecs"].values()] if doc["kind"] == "TFJob"
             else [doc["spec"]["template"]["spec"]] if doc["kind"] in ("StatefulSet", "Job") else [])
    ports = list(doc["spec"].get("ports", [])) if doc["kind"] == "Service" else []
    for spec in specs:
        for c in spec["containers"]:
            if not DNS1123.fullmatch(c["name"]):
                errors.append(f"container name {c['name']!r} is not a DNS-1123 label")
            ports += c.get("ports", [])
        for v in spec.get("volumes", []):
            if not DNS1123.fullmatch(v["name"]):
                errors.append(f"volume name {v['name']!r} is not a DNS-1123 label")
    for port in ports:
        if "name" in port and not PORT_NAME.fullmatch(port["name"]):
            errors.append(f"port name {port['name']!r} is not an IANA service name (15 characters at most)")
    return errors


def object_errors(doc: dict) -> list[str]:
    """What is wrong with one manifest object: [] when the API would take it."""
    kind = doc.get("kind")
    if kind == "TFJob":
        errors = schema_errors(doc, TFJOB_SCHEMA, kind)
        return errors or tfjob_webhook_errors(doc) + name_errors(doc)
    if kind not in KINDS:
        return [f"{kind}: not a kind these manifests should hold"]
    if doc.get("apiVersion") != KINDS[kind]:
        return [f"{kind}: apiVersion {KINDS[kind]} expected, got {doc.get('apiVersion')!r}"]
    return schema_errors(doc, f"V1{kind}", kind) or name_errors(doc)


def _objects(p) -> list[dict]:
    return kube.load(p)


def _pod_specs(p) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template of the manifests ``p``."""
    out = []
    for doc in _objects(p):
        if doc["kind"] == "TFJob":
            for t, spec in doc["spec"]["tfReplicaSpecs"].items():
                out.append((f"TFJob {t}", spec["template"]["spec"]))
        elif doc["kind"] in ("StatefulSet", "Job"):
            out.append((f"{doc['kind']} {doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
    return out


def test_the_manifests_are_where_the_docs_say():
    assert {f.relative_to(DEPLOY).as_posix() for f in FILES} == {
        "tfjob.yaml", "tfjob-gpu.yaml", "plain/settings.yaml", "plain/ps.yaml", "plain/workers.yaml",
        "plain/gpu/workers.yaml", "elastic/settings.yaml", "elastic/ps.yaml", "elastic/workers.yaml"}


@pytest.mark.parametrize("path", FILES, ids=_id)
def test_every_object_is_a_valid_object_of_the_kubernetes_api(path):
    docs = _objects(path)
    assert docs
    for doc in docs:
        assert object_errors(doc) == [], doc["metadata"]["name"]


def test_the_strict_check_refuses_an_unknown_field_a_wrong_type_and_a_missing_required_one():
    ps = next(d for d in _objects(PLAIN / "ps.yaml") if d["kind"] == "StatefulSet")
    assert object_errors(ps) == []
    bad = copy.deepcopy(ps)
    c = bad["spec"]["template"]["spec"]["containers"][0]
    c["livenesProbe"] = c.pop("livenessProbe")  # a typo the client would drop silently
    c["readinessProbe"]["grpc"]["port"] = "50051"
    del bad["spec"]["selector"]
    errors = object_errors(bad)
    assert any("livenesProbe: no such field in V1Container" in e for e in errors), errors
    assert any("grpc.port: int expected" in e for e in errors), errors
    missing = copy.deepcopy(ps)
    del missing["spec"]["selector"]
    assert any("selector" in e for e in object_errors(missing))
    job = next(d for d in _objects(TFJOB) if d["kind"] == "TFJob")
    assert object_errors(job) == []
    bad = copy.deepcopy(job)
    bad["spec"]["tfReplicaSpecs"]["PS"]["restartPolicy"] = "Sometimes"
    bad["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    bad["spec"]["tfReplicaSpecs"]["Ps2"] = {}
    bad["spec"]["runPolicy"]["cleanPodPolicies"] = "All"
    errors = object_errors(bad)
    assert len(errors) == 4, errors
    for wrong in ("runPolicy.cleanPodPolicies: no such field", "PS.restartPolicy: one of",
                  "containers[0].imagePullPolicy: str expected", "tfReplicaSpecs.Ps2: no such field"):
        assert any(wrong in e for e in errors), (wrong, errors)
    assert object_errors({"apiVersion": "v1", "kind": "Job"}) != []


def test_the_webhook_and_name_rules_refuse_what_the_operator_and_the_api_server_would():
    job = next(d for d in _objects(TFJOB) if d["kind"] == "TFJob")
    bad = copy.deepcopy(job)
    bad["metadata"]["name"] = "9tfps"
    bad["spec"]["tfReplicaSpecs"]["Master"] = copy.deepcopy(bad["spec"]["tfReplicaSpecs"]["Chief"])
    bad["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    bad["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]["ports"][0]["name"] = "tfjob-grpc-port-x"
    errors = object_errors(bad)
    for wrong in ("DNS-1035", "more than one Chief", "Worker: no container named tensorflow",
                  "'tfjob-grpc-port-x' is not an IANA"):
        assert any(wrong in e for e in errors), (wrong, errors)


# -- images ----------------------------------------------------------------------------------
def _stages() -> dict[str, dict]:
    """docker/Dockerfile's stages: {name: {"from": parent, "env": {TFPS_*}, "entrypoint": [...]}}."""
    text = re.sub(r"\\\n", " ", (ROOT / "docker" / "Dockerfile").read_text())
    stages: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line)
        if m:
            current = stages.setdefault(m.group(2), {"from": m.group(1), "env": {}, "entrypoint": None})
        elif current is not None and line.startswith("ENV "):
            current["env"].update(dict(re.findall(r"(TFPS_\w+)=(\S+)", line)))
        elif current is not None and line.startswith("ENTRYPOINT "):
            current["entrypoint"] = json.loads(line.split(None, 1)[1])
    return stages


def _stage_env(stages, name) -> dict:
    env = {}
    while name in stages:
        env = {**stages[name]["env"], **env}
        name = stages[name]["from"]
    return env


def test_kube_knows_the_images_entrypoints_and_environment_as_the_dockerfile_sets_them():
    stages = _stages()
    for repo, target in (("tfps-server", "server"), ("tfps-worker", "worker")):
        assert tuple(stages[target]["entrypoint"]) == kube.IMAGE_ENTRYPOINT[repo]
        assert _stage_env(stages, target) == kube.IMAGE_ENV[repo]
    assert kube.IMAGE_ENV["tfps-server"]["TFPS_PORT"] == "50051"  # the walk sees the ENV at all


def _compose_images() -> set[str]:
    text = "".join((ROOT / "docker" / f).read_text() for f in ("compose.yaml", "compose.gpu.yaml"))
    return set(re.findall(r"image: \$\{\w+:-([^}]+)\}", text))


@pytest.mark.parametrize("p", ALL_SETS, ids=_id)
def test_every_image_is_one_of_docker_under_its_compose_name(p):
    images = _compose_images()
    assert images == {"tfps-server:latest", "tfps-worker:latest", "tfps-worker:gpu"}
    gpu = p in (TFJOB_GPU, PLAIN_GPU)
    for r in kube.replicas(p):
        assert r.image in images
        expected = "tfps-server:latest" if r.role == "ps" else ("tfps-worker:gpu" if gpu else "tfps-worker:latest")
        assert r.image == expected, (r.pod_name, r.image)


def test_image_repository_ignores_the_registry_tag_and_digest():
    assert kube.image_repository("registry.example.com:5000/team/tfps-server:0.1@sha256:ab") == "tfps-server"
    assert kube.image_repository("tfps-worker") == "tfps-worker"


# -- probes, resources, GPUs --------------------------------------------------------------------
def _server_containers(p):
    for where, spec in _pod_specs(p):
        for c in spec["containers"]:
            if kube.image_repository(c["image"]) == "tfps-server":
                yield where, c


@pytest.mark.parametrize("p", ALL_SETS, ids=_id)
def test_every_server_has_grpc_health_probes_on_the_port_it_listens_on(p):
    servers = [r for r in kube.replicas(p) if r.role == "ps"]
    assert len(servers) == (1 if p == ELASTIC else 2)  # elastic sync: one server
    (c,) = [c for _, c in _server_containers(p)]  # one template for every shard
    for r in servers:
        port = ServerConfig.from_args(r.process_argv[1:], r.env).port
        assert port == r.port == 50051
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port, probe
            assert c[probe]["grpc"].get("service", "") in ("", "tfps.v1.ParameterServer")
        assert port in [q["containerPort"] for q in c["ports"]]


def test_the_probe_check_sees_a_server_moved_to_another_port():
    # TFPS_PORT set in the manifest wins over the image's and TF_CONFIG's: the probes would miss it.
    (r, _) = [r for r in kube.replicas(TFJOB) if r.role == "ps"]
    assert ServerConfig.from_args([], {**r.env, "TFPS_PORT": "2222"}).port == 2222 != r.port


_MEMORY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}


def _bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", q)
    assert m, q
    return int(m.group(1)) * _MEMORY[m.group(2)]


@pytest.mark.parametrize("p", ALL_SETS, ids=_id)
def test_every_container_requests_and_limits_cpu_and_memory(p):
    for where, spec in _pod_specs(p):
        for c in spec["containers"]:
            res = c["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res[kind]), (where, kind)
            assert _bytes(res["limits"]["memory"]) >= _bytes(res["requests"]["memory"]), where
            assert float(res["limits"]["cpu"]) >= float(res["requests"]["cpu"]), where


def _without_gpu(docs: list[dict]) -> list[dict]:
    """The objects with their GPU parts taken out and the worker image set back to CPU."""
    docs = copy.deepcopy(docs)
    for doc in docs:
        specs = ([s["template"]["spec"] for s in doc["spec"]["tfReplicaSpecs"].values()] if doc["kind"] == "TFJob"
                 else [doc["spec"]["template"]["spec"]] if doc["kind"] in ("StatefulSet", "Job") else [])
        for spec in specs:
            spec["tolerations"] = [t for t in spec.get("tolerations", []) if t["key"] != "nvidia.com/gpu"]
            if not spec["tolerations"]:
                del spec["tolerations"]
            for c in spec["containers"]:
                for kind in ("requests", "limits"):
                    c["resources"][kind].pop("nvidia.com/gpu", None)
                if c["image"] == "tfps-worker:gpu":
                    c["image"] = "tfps-worker:latest"
    return docs


@pytest.mark.parametrize("cpu, gpu", [(TFJOB, TFJOB_GPU), (PLAIN / "workers.yaml", PLAIN_GPU[2])], ids=_id)
def test_the_gpu_variant_differs_only_in_the_worker_image_its_gpu_and_a_toleration(cpu, gpu):
    cpu_docs, gpu_docs = _objects(cpu), _objects(gpu)
    assert _without_gpu(gpu_docs) == cpu_docs
    assert _without_gpu(cpu_docs) == cpu_docs  # the CPU files ask for no GPU
    for where, spec in _pod_specs(gpu):
        for c in spec["containers"]:
            asks = c["resources"]["limits"].get("nvidia.com/gpu")
            if kube.image_repository(c["image"]) == "tfps-server":
                assert asks is None, where  # the servers never use a GPU
            else:
                assert asks == "1" and c["resources"]["requests"]["nvidia.com/gpu"] == "1", where
                assert c["image"] == "tfps-worker:gpu"
                assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_the_gpu_comparison_sees_another_difference():
    gpu = _objects(TFJOB_GPU)
    next(d for d in gpu if d["kind"] == "TFJob")["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = 5
    assert _without_gpu(gpu) != _objects(TFJOB)


# -- TF_CONFIG, as the training-operator writes it --------------------------------------------------
def test_tfjob_tf_config_is_the_operators_byte_for_byte():
    # genTFConfigJSONStr and genClusterSpec (training-operator v1.9,
    # pkg/controller.v1/tensorflow/tensorflow.go): "<job>-<type>-<i>.<namespace>.svc:<port>",
    # Go's json.Marshal of {cluster, task, environment: "cloud"}, the map's keys sorted.
    ps0 = kube.replicas(TFJOB)[0]
    assert (ps0.role, ps0.index, ps0.hostname, ps0.port) == ("ps", 0, "tfps-ps-0.default.svc", 50051)
    assert ps0.env["TF_CONFIG"] == (
        '{"cluster":{"chief":["tfps-chief-0.default.svc:2222"],'
        '"ps":["tfps-ps-0.default.svc:50051","tfps-ps-1.default.svc:50051"],'
        '"worker":["tfps-worker-0.default.svc:2222","tfps-worker-1.default.svc:2222"]},'
        '"task":{"type":"ps","index":0},"environment":"cloud"}')
    other = kube.replicas(TFJOB, job_name="run7", namespace="ml", custom_cluster_domain="cluster.local")
    assert [r.hostname for r in other] == [
        "run7-ps-0.ml.svc.cluster.local", "run7-ps-1.ml.svc.cluster.local", "run7-chief-0.ml.svc.cluster.local",
        "run7-worker-0.ml.svc.cluster.local", "run7-worker-1.ml.svc.cluster.local"]
    assert other[4].tf_config["task"] == {"type": "worker", "index": 1}
    assert other[4].tf_config["cluster"]["ps"] == ["run7-ps-0.ml.svc.cluster.local:50051",
                                                   "run7-ps-1.ml.svc.cluster.local:50051"]


def _tfjob(**specs) -> dict:
    doc = {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "j"}, "spec": {"tfReplicaSpecs": {}}}
    for t, (n, ports) in specs.items():
        doc["spec"]["tfReplicaSpecs"][t] = {"replicas": n, "template": {"spec": {"containers": [
            {"name": "tensorflow", "image": "tfps-worker", "ports": ports}]}}}
    return doc


def test_kube_follows_the_operators_defaults():
    # No tfjob-port: 2222. Replica types in any case ("ps" is PS). One replica in all: no TF_CONFIG.
    reps = kube.tfjob_replicas(_tfjob(ps=(1, [{"name": "grpc", "containerPort": 9}]), worker=(2, None)))
    assert [(r.role, r.index, r.address) for r in reps] == [
        ("ps", 0, "j-ps-0.default.svc:2222"), ("worker", 0, "j-worker-0.default.svc:2222"),
        ("worker", 1, "j-worker-1.default.svc:2222")]
    (alone,) = kube.tfjob_replicas(_tfjob(Worker=(1, None)))
    assert "TF_CONFIG" not in alone.env
    with pytest.raises(ValueError, match="Boss"):
        kube.tfjob_replicas(_tfjob(Boss=(1, None)))
    with pytest.raises(ValueError, match="job_name"):
        kube.replicas(PLAIN, job_name="x")


# -- each replica, resolved by tfps' own configuration code -------------------------------------------
def _resolve(r: kube.Replica):
    program, *args = r.process_argv
    assert program == {"ps": "ps-server"}.get(r.role, "ps-worker")
    return (ServerConfig if program == "ps-server" else WorkerConfig).from_args(args, r.env)


@pytest.mark.parametrize("p", TFJOBS, ids=_id)
def test_each_tfjob_replica_resolves_to_its_role_index_shards_and_worker_count(p):
    reps = kube.replicas(p)
    assert [(r.role, r.index) for r in reps] == [("ps", 0), ("ps", 1), ("chief", 0), ("worker", 0), ("worker", 1)]
    shards = [r.address for r in reps if r.role == "ps"]
    assert shards == ["tfps-ps-0.default.svc:50051", "tfps-ps-1.default.svc:50051"]
    for r in reps:
        config = _resolve(r)
        assert config.num_workers == 3
        if r.role == "ps":
            assert (config.host, config.port) == ("0.0.0.0", r.port)
            assert config.checkpoint_dir == "/data/checkpoints"
            assert not config.exit_when_done  # restartPolicy Always would start it again
            assert config.dead_worker_policy == "wait"
        else:
            assert config.ps_addresses == shards
            assert config.worker_index == (0 if r.role == "chief" else r.index + 1)
            assert config.is_chief == (r.role == "chief")
            assert config.global_batch_size == 96
            assert bool(config.result_json) == (r.role == "chief")


@pytest.mark.parametrize("p", PLAINS, ids=_id)
def test_each_plain_replica_resolves_to_its_role_shards_and_worker_count(p):
    reps = kube.replicas(p)
    job = next(d for d in _objects(p) if d["kind"] == "Job")["spec"]
    assert job["completions"] == job["parallelism"]
    assert [(r.role, r.index, r.hostname) for r in reps] == [
        ("ps", 0, "tfps-ps-0.tfps-ps"), ("ps", 1, "tfps-ps-1.tfps-ps"),
        *[("worker", i, f"tfps-worker-{i}.tfps-workers") for i in range(job["completions"])]]
    shards = [r.address for r in reps if r.role == "ps"]
    for r in reps:
        config = _resolve(r)
        assert config.num_workers == job["completions"]
        if r.role == "ps":
            assert (config.host, config.port) == ("0.0.0.0", 50051)
            assert config.checkpoint_dir == "/data/checkpoints"
        else:
            assert config.ps_addresses == shards  # TFPS_PS names every shard, in order
            assert config.worker_index == AUTO_INDEX  # the server hands out 0..N-1
            assert r.env["JOB_COMPLETION_INDEX"] == str(r.index)


PER_WORKER = ("worker_index", "result_json", "save_model", "save_weights")


def _training(config) -> dict:
    """A worker's configuration without what differs from worker to worker by design."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in PER_WORKER}


@pytest.mark.parametrize("p", ALL_SETS, ids=_id)
def test_every_worker_trains_the_same_model_the_same_way_and_every_shard_serves_alike(p):
    reps = kube.replicas(p)
    workers = [_training(_resolve(r)) for r in reps if r.role != "ps"]
    assert all(w == workers[0] for w in workers), p
    servers = [_resolve(r) for r in reps if r.role == "ps"]
    assert all(s == servers[0] for s in servers), p


def test_the_resolution_check_sees_a_worker_count_that_disagrees():
    reps = kube.replicas(PLAIN)
    w = next(r for r in reps if r.role == "worker")
    assert WorkerConfig.from_args(w.process_argv[1:], {**w.env, "TFPS_NUM_WORKERS": "4"}).num_workers == 4
    with pytest.raises(ConfigError):
        WorkerConfig.from_args(w.process_argv[1:], {**w.env, "TFPS_PS": "tfps-ps-0.tfps-ps"})


def test_no_pod_gets_service_links_which_would_set_tfps_port_to_a_url():
    # A Service named "tfps" in the namespace would give every pod TFPS_PORT=tcp://IP:PORT,
    # and TFPS_PORT is the server's port setting.
    with pytest.raises(ConfigError, match="TFPS_PORT"):
        ServerConfig.from_args([], {"TFPS_PORT": "tcp://10.0.0.1:50051"})
    for p in ALL_SETS:
        for where, spec in _pod_specs(p):
            assert spec["enableServiceLinks"] is False, where


# -- restart policies, volumes, names -----------------------------------------------------------------
@pytest.mark.parametrize("p", TFJOBS, ids=_id)
def test_tfjob_servers_always_restart_and_workers_are_recreated_after_a_signal_only(p):
    # A server's SIGTERM (a failed liveness probe) ends in exit 0 after a final checkpoint:
    # only Always starts it again. A worker's error exit (1, 2) must fail the job: ExitCode.
    doc = next(d for d in _objects(p) if d["kind"] == "TFJob")
    assert {t: s["restartPolicy"] for t, s in doc["spec"]["tfReplicaSpecs"].items()} == {
        "PS": "Always", "Chief": "ExitCode", "Worker": "ExitCode"}
    assert "successPolicy" not in doc["spec"]  # the default: the job's outcome is the chief's
    assert doc["spec"]["runPolicy"]["cleanPodPolicy"] in ("Running", "All")  # the servers go with the job


def test_the_workers_job_fails_at_once_on_tfps_errors_and_retries_kills():
    for p in (PLAIN / "workers.yaml", PLAIN_GPU[2]):
        job = next(d for d in _objects(p) if d["kind"] == "Job")["spec"]
        spec = job["template"]["spec"]
        assert spec["restartPolicy"] == "Never" and job["completionMode"] == "Indexed"
        fail = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
        assert fail[0]["onExitCodes"] == {"containerName": spec["containers"][0]["name"], "operator": "In",
                                          "values": [1, 2]}


def test_every_server_checkpoints_into_a_persistent_volume_of_its_own():
    doc = next(d for d in _objects(TFJOB) if d["kind"] == "TFJob")
    ps = doc["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]
    (mount,) = ps["containers"][0]["volumeMounts"]
    reps = [r for r in kube.replicas(TFJOB) if r.role == "ps"]
    assert mount["mountPath"] == reps[0].env["TFPS_CHECKPOINT_DIR"]
    # One directory per shard: $(POD_NAME), the pod name a recreated replica keeps.
    assert [kube.expand(mount["subPathExpr"], r.env) for r in reps] == ["tfps-ps-0", "tfps-ps-1"]
    (volume,) = ps["volumes"]
    claims = {d["metadata"]["name"] for d in _objects(TFJOB) if d["kind"] == "PersistentVolumeClaim"}
    assert volume["name"] == mount["name"] and volume["persistentVolumeClaim"]["claimName"] in claims
    sts = next(d for d in _objects(PLAIN) if d["kind"] == "StatefulSet")
    (mount,) = sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert mount["name"] in [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]
    assert mount["mountPath"] == "/data/checkpoints"


def test_every_volume_a_pod_mounts_is_declared_and_every_claim_exists():
    for p in ALL_SETS:
        claims = {d["metadata"]["name"] for d in _objects(p) if d["kind"] == "PersistentVolumeClaim"}
        templates = {t["metadata"]["name"] for d in _objects(p) if d["kind"] == "StatefulSet"
                     for t in d["spec"].get("volumeClaimTemplates", [])}
        for where, spec in _pod_specs(p):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in spec["containers"]:
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes or m["name"] in templates, (where, m)
            for v in volumes.values():
                assert v["persistentVolumeClaim"]["claimName"] in claims, where


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_plain_names_come_from_headless_services_that_select_their_pods():
    docs = _objects(PLAIN)
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    job = next(d for d in docs if d["kind"] == "Job")
    for service, template in ((sts["spec"]["serviceName"], sts["spec"]["template"]),
                              (job["spec"]["template"]["spec"]["subdomain"], job["spec"]["template"])):
        assert services[service]["clusterIP"] == "None"
        assert _matches(services[service]["selector"], template["metadata"]["labels"])
    assert _matches(sts["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    assert services["tfps-ps"]["ports"][0]["port"] == 50051
    ps_selector = services["tfps-ps"]["selector"]
    assert not _matches(ps_selector, job["spec"]["template"]["metadata"]["labels"])  # the workers are not servers
    settings = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert settings["TFPS_PS"].split(",") == [f"tfps-ps-{i}.tfps-ps:50051" for i in range(sts["spec"]["replicas"])]
    assert int(settings["TFPS_NUM_WORKERS"]) == job["spec"]["completions"]


# -- the elastic variant: a worker set scaled while the job runs --------------------------------------
def _elastic_settings(docs) -> dict:
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]


def elastic_errors(docs: list[dict]) -> list[str]:
    """What keeps the elastic manifests from scaling between their minimum and maximum
    workers; [] when nothing does."""
    settings = _elastic_settings(docs)
    low, high = int(settings["TFPS_ELASTIC_MIN_WORKERS"]), int(settings["TFPS_NUM_WORKERS"])
    job = next(d for d in docs if d["kind"] == "Job")["spec"]
    errors = []
    if job.get("completionMode", "NonIndexed") != "NonIndexed" or "completions" in job:
        errors.append("the workers' Job must be a work queue (NonIndexed, no completions): complete once "
                      "a worker finished and every pod ended")
    if not low <= job.get("parallelism", 1) <= high:
        errors.append(f"parallelism {job.get('parallelism', 1)} is outside {low}..{high}")
    if job["template"]["spec"]["restartPolicy"] != "Never":
        errors.append("a finished worker must not be started again: restartPolicy Never")
    return errors


def _scaled(tmp_path, docs: list[dict], parallelism: int) -> list[kube.Replica]:
    """The replicas once `kubectl patch job ... parallelism` set it (the manifests rewritten)."""
    docs = copy.deepcopy(docs)
    next(d for d in docs if d["kind"] == "Job")["spec"]["parallelism"] = parallelism
    path = tmp_path / f"elastic-{parallelism}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return kube.replicas(path)


def test_the_elastic_workers_are_a_work_queue_job_started_at_the_minimum():
    docs = _objects(ELASTIC)
    assert elastic_errors(docs) == []
    job = next(d for d in docs if d["kind"] == "Job")["spec"]
    assert job["parallelism"] == int(_elastic_settings(docs)["TFPS_ELASTIC_MIN_WORKERS"])
    fail = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail[0]["onExitCodes"] == {"containerName": "worker", "operator": "In", "values": [1, 2]}


def test_every_elastic_replica_resolves_to_one_elastic_server_and_auto_index_workers_at_each_size(tmp_path):
    docs = _objects(ELASTIC)
    settings = _elastic_settings(docs)
    low, high = int(settings["TFPS_ELASTIC_MIN_WORKERS"]), int(settings["TFPS_NUM_WORKERS"])
    assert 1 <= low < high
    for n in range(low, high + 1):
        reps = _scaled(tmp_path, docs, n)
        (server,) = [r for r in reps if r.role == "ps"]
        workers = [r for r in reps if r.role == "worker"]
        assert len(workers) == n
        ps = _resolve(server)
        assert (ps.mode, ps.elastic_min_workers, ps.num_workers) == ("sync", low, high)
        assert ps.micro_batches == high  # at full size each worker computes one micro-batch a round
        assert not ps.exit_when_done  # a StatefulSet would start it again
        for w in workers:
            config = _resolve(w)
            assert config.elastic and config.worker_index == AUTO_INDEX
            assert config.num_workers == ps.num_workers  # the server refuses any other count
            assert config.ps_addresses == [server.address]
            assert config.result_json  # every pod may become the chief (worker 0): the first to register


def test_the_elastic_check_refuses_a_size_outside_min_max_and_an_indexed_job(tmp_path):
    docs = _objects(ELASTIC)
    settings = _elastic_settings(docs)
    low, high = int(settings["TFPS_ELASTIC_MIN_WORKERS"]), int(settings["TFPS_NUM_WORKERS"])
    for n in (low - 1, high + 1):
        bad = copy.deepcopy(docs)
        next(d for d in bad if d["kind"] == "Job")["spec"]["parallelism"] = n
        assert elastic_errors(bad) == [f"parallelism {n} is outside {low}..{high}"]
    indexed = copy.deepcopy(docs)
    next(d for d in indexed if d["kind"] == "Job")["spec"].update(completionMode="Indexed", completions=2)
    assert "work queue" in elastic_errors(indexed)[0]
    counted = copy.deepcopy(docs)
    next(d for d in counted if d["kind"] == "Job")["spec"]["completions"] = 2
    path = tmp_path / "counted.yaml"
    path.write_text(yaml.safe_dump_all(counted))
    with pytest.raises(ValueError, match="work queue"):
        kube.replicas(path)
    # A minimum above the maximum: the server itself refuses to start.
    (server,) = [r for r in kube.replicas(ELASTIC) if r.role == "ps"]
    with pytest.raises(ConfigError, match="above --num-workers"):
        ServerConfig.from_args([], {**server.env, "TFPS_ELASTIC_MIN_WORKERS": str(high + 1)})
    (w, *_) = [r for r in kube.replicas(ELASTIC) if r.role == "worker"]
    # Elastic sync over two shards: the worker takes them (shard 0 deals, the other follows).
    two = WorkerConfig.from_args(w.process_argv[1:], {**w.env, "TFPS_PS": f"{server.address},other:50051"})
    assert two.elastic and two.ps_addresses == [server.address, "other:50051"]


def test_the_elastic_and_plain_objects_can_share_a_namespace():
    plain, elastic = _objects(PLAIN), _objects(ELASTIC)
    names = lambda docs: {(d["kind"], d["metadata"]["name"]) for d in docs}  # noqa: E731
    assert not names(plain) & names(elastic)
    templates = lambda docs: [d["spec"]["template"]["metadata"]["labels"] for d in docs  # noqa: E731
                              if d["kind"] in ("StatefulSet", "Job")]
    for mine, theirs in ((plain, elastic), (elastic, plain)):
        for service in (d for d in mine if d["kind"] == "Service"):
            assert not any(_matches(service["spec"]["selector"], t) for t in templates(theirs)), service
    (service,) = [d for d in elastic if d["kind"] == "Service"]
    sts = next(d for d in elastic if d["kind"] == "StatefulSet")
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert _matches(service["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert _elastic_settings(elastic)["TFPS_PS"] == f"{sts['metadata']['name']}-0.{service['metadata']['name']}:50051"


# -- ps_tools.kube itself -------------------------------------------------------------------------
def test_expand_follows_kubernetes():
    env = {"A": "x", "B": "$(A)"}
    assert kube.expand("$(A)/$(C)/$$(A)/$$", env) == "x/$(C)/$(A)/$"


@pytest.mark.parametrize("argv, runs", [
    (("tfps-entrypoint", "ps-server"), ["ps-server"]),
    (("tfps-entrypoint", "ps-worker", "--worker-index", "auto"), ["ps-worker", "--worker-index", "auto"]),
    (("tfps-entrypoint", "ps-worker", "python", "-c", "1"), ["python", "-c", "1"]),
    (("ps-server", "--port", "1"), ["ps-server", "--port", "1"]),
])
def test_process_argv_is_what_the_entrypoint_runs(argv, runs):
    r = kube.Replica("ps", 0, "p", "p", 1, "tfps-server", "c", argv, {})
    assert r.process_argv == runs


def test_env_order_is_the_kubelets_and_unresolvable_sources_are_refused():
    c = {"name": "c", "image": "tfps-server:1", "envFrom": [{"configMapRef": {"name": "m"}, "prefix": "X_"}],
         "env": [{"name": "TFPS_PORT", "value": "7"}, {"name": "N", "valueFrom": {"fieldRef": {
             "fieldPath": "metadata.name"}}}, {"name": "P", "value": "$(N):$(TFPS_PORT)"}],
         "args": ["--mode", "$(X_M)"]}
    env, argv = kube.container_env_argv(c, {"name": "pod", "namespace": "ns"}, {"m": {"M": "async"}}, {"T": "1"})
    assert env == {"TFPS_HOST": "0.0.0.0", "TFPS_PORT": "7", "X_M": "async", "N": "pod", "P": "pod:7", "T": "1"}
    assert argv == ["tfps-entrypoint", "ps-server", "--mode", "async"]
    c["env"].append({"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
    with pytest.raises(ValueError, match="offline"):
        kube.container_env_argv(c, {"name": "pod", "namespace": "ns"}, {"m": {}})


def test_hosts_file_lists_every_name_of_every_replica():
    reps = kube.replicas(TFJOB)
    text = kube.hosts_file(reps, {r.pod_name: f"10.0.0.{i + 1}" for i, r in enumerate(reps)})
    first = text.splitlines()[0].split()
    assert first[:3] == ["10.0.0.1", "tfps-ps-0.default.svc", "tfps-ps-0.default.svc.cluster.local"]
    assert first[-1] == "tfps-ps-0" and len(text.splitlines()) == 5
    for r in reps:  # every host a TF_CONFIG entry names has an address
        for entry in [e for es in r.tf_config["cluster"].values() for e in es]:
            assert re.search(rf"\s{re.escape(entry.rpartition(':')[0])}(\s|$)", text, re.M), entry


@pytest.mark.parametrize("p", [TFJOB, PLAIN, ELASTIC], ids=_id)
def test_the_commands_themselves_print_the_resolved_configuration_for_a_server_and_a_worker(p):
    # The programs the entrypoint runs, through their own command line (``--print-config``),
    # in an environment holding nothing of this one's TFPS_* or TF_CONFIG.
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("TFPS_") and k != "TF_CONFIG"}
    reps = kube.replicas(p)
    for r in (reps[0], reps[-1]):
        program, *args = r.process_argv
        module = {"ps-server": "ps_server.cli", "ps-worker": "worker.cli"}[program]
        done = subprocess.run([sys.executable, "-m", module, *args, "--print-config"], cwd=ROOT,
                              env={**base, **r.env}, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == dataclasses.asdict(_resolve(r)), r.pod_name
