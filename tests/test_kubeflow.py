"""configs/kubeflow_tfjob_classify.yaml: the TF_CONFIG the Kubeflow operator writes for it is accepted.

The training-operator gives every TFJob pod a TF_CONFIG built from the manifest
(`genTFConfigJSONStr` / `genClusterSpec` in kubeflow/training-operator,
pkg/controller.v1/tensorflow): cluster keys are the lowercase replica types (the `Evaluator`
type may be left out), hosts are the pods' headless services `<job>-<type>-<index>.<namespace>.svc`
(plus `.<CUSTOM_CLUSTER_DOMAIN>` when the operator has one), the port is the container port
named `tfjob-port` of the container named `tensorflow` (default 2222), and an `"environment":
"cloud"` key that TensorFlow >= 1.4 ignores. `operator_tf_config` below does the same from the
parsed manifest, and `tfmp.distribute.cluster.parse_tf_config` must accept it as is.

The manifest is read with PyYAML when it is installed (it is not a tfmp dependency), else with
the small block-YAML reader below, which covers what the manifest uses.
"""

import json
import os
import re

import pytest
from conftest import ROOT, run_python

from tfmp.distribute.cluster import parse_tf_config
from tfmp.errors import UsageError

MANIFEST = os.path.join(ROOT, "configs", "kubeflow_tfjob_classify.yaml")
OPERATOR_DEFAULT_PORT = 2222  # tfv1.DefaultPort
OPERATOR_CONTAINER, OPERATOR_PORT_NAME = "tensorflow", "tfjob-port"
NETWORK_POLICY = os.path.join(ROOT, "configs", "kubeflow_networkpolicy.yaml")
# The label the training-operator puts on every pod of a job (kubeflow/common's JobNameLabel),
# besides the pod template's own labels.
OPERATOR_JOB_LABEL = "training.kubeflow.org/job-name"


def _strip_comment(line: str) -> str:
    quote = None
    for position, char in enumerate(line):
        if char in "\"'" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (position == 0 or line[position - 1] in " \t"):
            return line[:position]
    return line


def _scalar(text: str):
    if text[:1] in "\"'" and text[-1:] == text[:1]:
        return text[1:-1]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False, "null": None, "~": None}.get(text, text)


def _block(lines, i: int):
    indent = lines[i][0]
    if lines[i][1].startswith("- "):
        return _sequence(lines, i, indent)
    return _mapping(lines, i, indent)


def _mapping(lines, i: int, indent: int):
    result = {}
    while i < len(lines) and lines[i][0] == indent and not lines[i][1].startswith("- "):
        key, _, rest = lines[i][1].partition(":")
        i += 1
        if rest.strip():
            result[key] = _scalar(rest.strip())
        elif i < len(lines) and (lines[i][0] > indent or lines[i][1].startswith("- ")):
            result[key], i = _block(lines, i)
        else:
            result[key] = None
    return result, i


def _sequence(lines, i: int, indent: int):
    result = []
    while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
        item = lines[i][1][2:].strip()
        if re.match(r"^[\w.\-/]+:(\s|$)", item):  # "- key: value" starts a mapping
            lines[i] = (indent + 2, item)
            value, i = _mapping(lines, i, indent + 2)
        else:
            value, i = _scalar(item), i + 1
        result.append(value)
    return result, i


def read_block_yaml(text: str):
    """Block mappings, sequences and plain or quoted scalars: the YAML a Kubernetes manifest uses."""
    lines = []
    for raw in text.splitlines():
        line = _strip_comment(raw).rstrip()
        if line.strip():
            lines.append((len(line) - len(line.lstrip(" ")), line.strip()))
    value, end = _block(lines, 0)
    assert end == len(lines), f"cannot read line {end + 1} of the manifest's YAML: {lines[end][1]!r}"
    return value


def _read_manifest(path: str):
    with open(path, encoding="utf-8") as file:
        text = file.read()
    parsed = read_block_yaml(text)
    try:
        import yaml  # optional: not a tfmp dependency
    except ImportError:
        return parsed
    assert yaml.safe_load(text) == parsed  # the reader reads it as YAML does
    return parsed


@pytest.fixture(scope="module")
def manifest():
    return _read_manifest(MANIFEST)


@pytest.fixture(scope="module")
def network_policy():
    return _read_manifest(NETWORK_POLICY)


def _container(replica_spec: dict) -> dict:
    containers = replica_spec["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == OPERATOR_CONTAINER)


def _port(replica_spec: dict) -> int:
    ports = _container(replica_spec).get("ports") or []
    return next((p["containerPort"] for p in ports if p["name"] == OPERATOR_PORT_NAME), OPERATOR_DEFAULT_PORT)


def operator_tf_config(
    tfjob: dict, namespace: str, replica_type: str, index: int, cluster_domain: str = ""
) -> str:
    """TF_CONFIG as the training-operator writes it for pod `replica_type`-`index` of `tfjob`."""
    name = tfjob["metadata"]["name"]
    cluster = {}
    for type_name, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        job = type_name.lower()
        hosts = [f"{name}-{job}-{i}.{namespace}.svc" for i in range(spec.get("replicas", 1))]
        if cluster_domain:
            hosts = [f"{host}.{cluster_domain}" for host in hosts]
        cluster[job] = [f"{host}:{_port(spec)}" for host in hosts]
    config = {
        "cluster": cluster,
        "task": {"type": replica_type.lower(), "index": index},
        "environment": "cloud",
    }
    return json.dumps(config, separators=(",", ":"), sort_keys=False)  # Go's json.Marshal layout


def test_manifest_is_a_tfjob_running_classify_multi_worker_on_a_shared_volume(manifest):
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "TFJob"
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Worker"} and specs["Worker"]["replicas"] >= 2
    worker = specs["Worker"]
    assert worker["restartPolicy"] == "OnFailure"
    container = _container(worker)
    command = container["command"]
    assert command[:3] == ["python", "-m", "apps.classify"]
    assert "--strategy=multi_worker" in command
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    model_dir = next(arg.split("=", 1)[1] for arg in command if arg.startswith("--model_dir="))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
    shared = next(name for name, path in mounts.items() if model_dir.startswith(path.rstrip("/") + "/"))
    assert "persistentVolumeClaim" in volumes[shared], "the model dir must be on a volume all workers share"


@pytest.mark.parametrize("cluster_domain", ["", "cluster.local"])
def test_every_worker_accepts_the_tf_config_the_operator_writes(manifest, cluster_domain):
    replicas = manifest["spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
    for index in range(replicas):
        raw = operator_tf_config(manifest, "tfmp", "Worker", index, cluster_domain)
        assert json.loads(raw)["environment"] == "cloud"
        config = parse_tf_config(raw)
        assert (config.task_type, config.task_index) == ("worker", index)
        assert config.num_workers == replicas
        assert config.is_chief == (index == 0)  # no Chief replica: worker 0 is the chief
        suffix = f".{cluster_domain}" if cluster_domain else ""
        assert config.address == f"tfmp-classify-worker-{index}.tfmp.svc{suffix}:2222"


def test_the_documented_tf_config_is_the_operators(manifest):
    documented = (
        '{"cluster":{"worker":["tfmp-classify-worker-0.tfmp.svc:2222","tfmp-classify-worker-1.tfmp.svc:2222"]},'
        '"task":{"type":"worker","index":0},"environment":"cloud"}'
    )
    with open(os.path.join(ROOT, "docs", "distributed.md"), encoding="utf-8") as file:
        assert documented in file.read()
    assert operator_tf_config(manifest, "tfmp", "Worker", 0) == documented


def test_a_chief_replica_is_the_chief_and_a_master_replica_is_refused(manifest):
    with_chief = json.loads(json.dumps(manifest))
    specs = with_chief["spec"]["tfReplicaSpecs"]
    specs["Chief"] = dict(specs["Worker"], replicas=1)
    chief = parse_tf_config(operator_tf_config(with_chief, "tfmp", "Chief", 0))
    worker = parse_tf_config(operator_tf_config(with_chief, "tfmp", "Worker", 0))
    assert chief.is_chief and not worker.is_chief and chief.num_workers == worker.num_workers == 3
    # TensorFlow's multi-worker strategy refuses a "master" task too; tfmp says so in one line.
    specs["Master"] = specs.pop("Chief")
    with pytest.raises(UsageError, match="unknown task type 'master'"):
        parse_tf_config(operator_tf_config(with_chief, "tfmp", "Master", 0))


def operator_pod_labels(tfjob: dict, replica_type: str, index: int) -> dict:
    """The labels of a pod the training-operator creates for `tfjob`: the template's, plus its own."""
    spec = tfjob["spec"]["tfReplicaSpecs"][replica_type]
    labels = dict((spec["template"].get("metadata") or {}).get("labels") or {})
    labels.update(
        {
            OPERATOR_JOB_LABEL: tfjob["metadata"]["name"],
            "training.kubeflow.org/replica-type": replica_type.lower(),
            "training.kubeflow.org/replica-index": str(index),
            "training.kubeflow.org/operator-name": "tfjob-controller",
        }
    )
    return labels


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def test_the_network_policy_admits_only_the_jobs_own_pods_to_the_worker_port(manifest, network_policy):
    """TensorFlow's worker port runs code for whoever connects (docs/security.md): the policy
    must select every pod of the TFJob, admit ingress only from pods of the same job (same
    namespace: no namespaceSelector or ipBlock), and only to the worker port."""
    assert (
        network_policy["apiVersion"] == "networking.k8s.io/v1" and network_policy["kind"] == "NetworkPolicy"
    )
    spec = network_policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    specs = manifest["spec"]["tfReplicaSpecs"]
    job_pods = [
        operator_pod_labels(manifest, replica_type, index)
        for replica_type, replica_spec in specs.items()
        for index in range(replica_spec.get("replicas", 1))
    ]
    other_job = operator_pod_labels(dict(manifest, metadata={"name": "another-job"}), "Worker", 0)
    assert all(_selects(spec["podSelector"], labels) for labels in job_pods)
    assert not _selects(spec["podSelector"], other_job)
    (rule,) = spec["ingress"]
    assert all(set(source) == {"podSelector"} for source in rule["from"]), "pods of this namespace only"
    assert all(any(_selects(s["podSelector"], labels) for s in rule["from"]) for labels in job_pods)
    assert not any(_selects(s["podSelector"], other_job) for s in rule["from"])
    worker_ports = {_port(replica_spec) for replica_spec in specs.values()}
    assert [(p["protocol"], p["port"]) for p in rule["ports"]] == [
        ("TCP", port) for port in sorted(worker_ports)
    ]


@pytest.mark.slow  # starts TensorFlow in a new process
def test_the_manifest_command_parses_with_its_app(manifest):
    command = _container(manifest["spec"]["tfReplicaSpecs"]["Worker"])["command"]
    assert command[:2] == ["python", "-m"]
    app, arguments = command[2], command[3:]
    check = f"from {app.rpartition('.')[0]} import {app.rpartition('.')[2]}; from absl import flags; "
    check += f"flags.FLAGS(['x', *{arguments!r}]); print('flags ok')"
    result = run_python(["-c", check])
    assert result.returncode == 0 and "flags ok" in result.stdout, result.stderr[-2000:]
