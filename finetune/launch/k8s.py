"""Kubernetes manifests that run `ft train` on a cluster (`ft launch --k8s`): a Kubeflow PyTorchJob (Training
Operator v1), or a JobSet (`--jobset`), planned for the cluster's nodes. docs/kubernetes.md explains them.

One pod per node, each running `ft train` (which prepares the data, and on node 0 writes the run folder, then starts
torchrun for the node's ranks); the nodes meet through torchrun's c10d rendezvous at node 0's address.
- The job file travels in a ConfigMap (mounted at /etc/ft); relative paths in it (data, output.dir) resolve against
  the working directory, the shared volume (a PersistentVolumeClaim, ReadWriteMany for several nodes), which holds
  the run folder, its checkpoints and the HF cache. output.dir must lie on it.
- Node rank, address and port come from the operator: the Training Operator sets MASTER_ADDR/MASTER_PORT and
  PET_NODE_RANK (pkg/controller.v1/pytorch/envvar.go, master.go at v1.9.4); a JobSet's Indexed Job sets
  JOB_COMPLETION_INDEX, and its headless service names pod 0 `<name>-node-0-0.<name>`. The operator also sets
  RANK and WORLD_SIZE in every pod, which would make `ft train` take itself for a torchrun rank (hardware.launch_env,
  runtime.launched): the command unsets them, and torchrun's PET_* defaults, before ft starts. Each pod's `ft train`
  chooses gloo's network interface (launch/netif.py), unless the pod's env sets GLOO_SOCKET_IFNAME.
- Stops: deleting or preempting a pod sends SIGTERM; ft stops after its step with a checkpoint and exits 143
  within terminationGracePeriodSeconds (the plan's stop time). Exit codes of 128 and above (a signal) restart the
  job, which resumes (output.resume=auto); below 128 (ft's config and usage errors, a crash) fail it at once:
  PyTorchJob `restartPolicy: ExitCode`; JobSet: a pod failure policy and a failure policy rule that fails the set.
- Secrets only by reference: `envFrom` a Kubernetes Secret (--secret); a secret written in clear in the job file or
  in --set is refused.
"""

from __future__ import annotations

import hashlib
import math
import os
import posixpath
import re
import shlex
import sys
from pathlib import Path

from finetune.artifacts.run import RunFolder
from finetune.distributed.runtime import NCCL_ENV
from finetune.errors import FtError
from finetune.launch.k8s_schema import schema_available, validate
from finetune.plan.launch import DEFAULT_PORT
from finetune.plan.memory import GiB

__all__ = ["KINDS", "job_name", "manifest", "node_command", "render", "validate", "write_manifest"]

KINDS = ("pytorchjob", "jobset")
CONTAINER = "pytorch"  # the Training Operator reads the exit code (and port) of the container of this name
PORT_NAME = "pytorchjob-port"  # ... and takes MASTER_PORT from the container port of this name
REPLICATED_JOB = "node"  # a JobSet's one replicated job: an Indexed Job with one pod per node
WORKDIR = "/data"  # where the shared volume is mounted, and the working directory (as in ft's images)
HF_HOME = f"{WORKDIR}/.cache/huggingface"  # models and data sets from the hub, downloaded once for every node
JOB_DIR, JOB_FILE = "/etc/ft", "job.yaml"  # the ConfigMap holding the job file
DEFAULT_VOLUME = "ft-data"  # the PersistentVolumeClaim used when --volume is not given
GPU_RESOURCE = "nvidia.com/gpu"
RANK_VARIABLE = {"pytorchjob": "PET_NODE_RANK", "jobset": "JOB_COMPLETION_INDEX"}  # this pod's node rank
# Set by the Training Operator in every pod; RANK and WORLD_SIZE would make ft a torchrun rank, PET_* are torchrun's
# defaults for its flags (ft passes its own)
LAUNCHER_ENV = (
    "RANK", "WORLD_SIZE", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"
)  # fmt: skip
PERMANENT_EXIT_CODES = list(range(1, 128))  # restarting cannot help; 128+N: stopped or killed by signal N
RESTARTS = 10  # restarts of the job (preemptions, node failures) before it counts as failed
CPU_SHARE = 0.9  # of the node's cores: the rest stays allocatable to the kubelet and daemon sets
MEMORY_MARGIN, MEMORY_BASE = 1.25, 4 * GiB  # host memory request: the plan's peak x margin + base (Python, loaders)
MAX_NAME = 40  # leaves room for the names operators derive (`<name>-node-0-<index>-xxxxx`, at most 63)
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance")
DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"  # a namespace's name
DNS1123_SUBDOMAIN = rf"{DNS1123_LABEL}(\.{DNS1123_LABEL})*"  # a PersistentVolumeClaim's or a Secret's


def write_manifest(
    config_path, overrides, hardware, out, *, image, kind="pytorchjob", namespace=None, volume=None, secret=None
) -> Path:
    """`ft launch --k8s`: check the job as `ft validate` does (data paths from here: the pods read the same relative
    paths from the volume), plan for the cluster's hardware, write the manifest (default OUTPUT_DIR/job-k8s.yaml)."""
    from finetune.files import atomic_write_text
    from finetune.workflow import check_job, compile_plan, refuse_ray

    kind = str(kind).lower()
    check_options(image, kind, namespace, volume, secret)
    config = check_job(config_path, overrides)
    for warning in data_off_volume(config):
        sys.stderr.write(f"warning: {warning}\n")
    job_plan = compile_plan(config_path, overrides, hardware, config)
    refuse_ray(job_plan, "--k8s")
    text = Path(config_path).read_text(encoding="utf-8")
    docs = manifest(
        job_plan, config, text, name=job_name(config), image=image, kind=kind, namespace=namespace,
        volume=volume, secret=secret, overrides=tuple(overrides), hardware=hardware,
    )  # fmt: skip
    if schema_available():
        for doc in docs:
            validate(doc)
    else:
        sys.stderr.write("warning: jsonschema or kubernetes-validate is not installed, so the manifest was not "
                         "checked against the Kubernetes schemas: pip install 'finetune[k8s]'\n")  # fmt: skip
    yaml_text = render(docs, header(job_plan, kind, secret, config))
    refuse_leaks(yaml_text)
    out = Path(out) if out else RunFolder(config.output.dir).k8s_path
    atomic_write_text(out, yaml_text)
    return out


def manifest(
    plan, config, config_text, *, name, image, kind, namespace, volume, secret, overrides, hardware=None
) -> list[dict]:
    """The documents to apply: the ConfigMap with the job file, then the PyTorchJob or JobSet. `hardware`: the
    description the plan was made for (see node_command)."""
    kind = str(kind).lower()
    check_options(image, kind, namespace, volume, secret)
    check_output_dir(config.output.dir)
    refuse_literal_secrets(config)
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    labels = dict(zip(LABELS, ("ft", name)))
    command = node_command(plan, kind, name, overrides, hardware)
    pod = pod_template(plan, kind, name, image, volume or DEFAULT_VOLUME, secret, command, labels)
    about = {"ft/plan": summary(plan)}
    job_meta = {**meta, "labels": labels, "annotations": about}
    job = pytorchjob(plan, job_meta, pod) if kind == "pytorchjob" else jobset(plan, job_meta, pod)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{name}-job", "labels": labels},
        "data": {JOB_FILE: config_text},
    }
    return [config_map, job]


# --------------------------------------------------------------------------------------------------- the jobs
def pytorchjob(plan, meta: dict, pod: dict) -> dict:
    """Master (node 0) and Worker (nodes 1..) replicas; a pod that exits with a signal's code is recreated."""
    replica = {"restartPolicy": "ExitCode", "template": pod}
    replicas = {"Master": {"replicas": 1, **replica}}
    if plan.nodes > 1:
        replicas["Worker"] = {"replicas": plan.nodes - 1, **replica}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": meta,
        "spec": {
            "nprocPerNode": str(plan.processes_per_node),
            # every pod of the job fails once per preemption; pods still running when the job ends are deleted
            "runPolicy": {"backoffLimit": RESTARTS * plan.nodes, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def jobset(plan, meta: dict, pod: dict) -> dict:
    """One Indexed Job with a pod per node. A pod that fails makes the Job fail (backoffLimit 0): with a code below
    128 through the pod failure policy, which fails the JobSet; with a signal's code, and the JobSet restarts once
    every pod of the previous attempt is gone (BlockingRecreate: their checkpoints are complete)."""
    fail = {
        "action": "FailJob",
        "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": Flow(PERMANENT_EXIT_CODES)},
    }
    job = {
        "parallelism": plan.nodes,
        "completions": plan.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [fail]},
        "template": {**pod, "spec": {"restartPolicy": "Never", **pod["spec"]}},
    }
    rule = {"name": "ftError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": RESTARTS, "restartStrategy": "BlockingRecreate", "rules": [rule]},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


# ---------------------------------------------------------------------------------------------------- the pod
def pod_template(plan, kind, name, image, volume, secret, command: str, labels) -> dict:
    gpus, port = gpus_per_pod(plan), kind == "pytorchjob" or plan.nodes > 1  # where the operator or the nodes use it
    container = {
        "name": CONTAINER,
        "image": image,
        "command": ["/bin/sh", "-c", command],
        "workingDir": WORKDIR,
        "env": pod_env(plan, kind, name),
        **({"envFrom": [{"secretRef": {"name": secret}}]} if secret else {}),
        **({"ports": [{"name": PORT_NAME, "containerPort": DEFAULT_PORT, "protocol": "TCP"}]} if port else {}),
        "resources": resources(plan, gpus),
        "volumeMounts": [
            {"name": "shared", "mountPath": WORKDIR},
            {"name": "job", "mountPath": JOB_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},  # NCCL's shared-memory transport, data loader workers
        ],
    }  # fmt: skip
    spec = {
        "terminationGracePeriodSeconds": plan.stop_seconds,  # SIGTERM to a complete checkpoint
        "containers": [container],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": volume}},
            {"name": "job", "configMap": {"name": f"{name}-job"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if gpus:  # GPU nodes are often tainted so that only pods asking for GPUs land there
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": labels}, "spec": spec}


def pod_env(plan, kind: str, name: str) -> list[dict]:
    env = [{"name": "HF_HOME", "value": HF_HOME}]
    env += [{"name": k, "value": v} for k, v in NCCL_ENV]  # read when each rank's process group starts
    if kind == "jobset":  # the Training Operator sets these itself in a PyTorchJob
        env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
        if plan.nodes > 1:
            env.append({"name": "MASTER_ADDR", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}"})
            env.append({"name": "MASTER_PORT", "value": str(DEFAULT_PORT)})
    return env


ENTRYPOINT = '"$(command -v ft-entrypoint || echo ft)"'  # ft-entrypoint passes its arguments on to ft


def node_command(plan, kind: str, name: str, overrides=(), hardware: str | None = None) -> str:
    """The shell command of each pod: `ft train` of the job file, resuming, with this node's place in the job.
    On GPUs ft probes the pod (the device plugin shows it the GPUs it asked for; ft checks that torch can use them);
    a CPU plan's process count is a choice, not something to probe: the pods get the plan's `hardware`."""
    if kind not in RANK_VARIABLE:
        raise FtError(f"the manifest kind {kind!r} is not one of {', '.join(KINDS)}")
    sets = [a for o in (*overrides, "output.resume=auto") for a in ("--set", o)]
    described = ["--hardware", hardware] if hardware and plan.device != "GPU" else []
    argv = ["ft", "train", f"{JOB_DIR}/{JOB_FILE}", *sets, *described]
    line = " ".join(shlex.quote(a) for a in argv)
    if plan.nodes > 1:  # double quotes: the pod's shell expands the operator's variables
        line += (
            f' --nnodes {plan.nodes} --node-rank "${RANK_VARIABLE[kind]}" --master-addr "$MASTER_ADDR"'
            f' --master-port "$MASTER_PORT" --rdzv-id {shlex.quote(name)}'
        )
    unset = " ".join(f"-u {v}" for v in LAUNCHER_ENV)
    # ft's CUDA images start ft through ft-entrypoint (the GPU check, DeepSpeed's kernel cache per CPU): kept here,
    # where it is; exec: ft is the process that receives the pod's SIGTERM
    line = line.replace("ft train ", f"{ENTRYPOINT} train ", 1)
    return f"exec env {unset} {line}"


def gpus_per_pod(plan) -> int:
    """The node's ranks, and the GPUs of a rollout server pool (rollout/pool.py: on every node, in use on node 0)."""
    if plan.device != "GPU":
        return 0
    return plan.processes_per_node + (plan.rollout.server_gpus if plan.rollout else 0)


def resources(plan, gpus: int) -> dict:
    """Requests from the plan: most of the node's cores, host memory for the plan's peak; GPUs (requests equal
    limits for extended resources). No CPU or memory limit: a limit below a passing peak would kill the job."""
    cpus = min(plan.cpus_per_node, max(plan.processes_per_node, math.floor(plan.cpus_per_node * CPU_SHARE)))
    memory = min(plan.host_capacity_bytes, plan.estimate.host_bytes * MEMORY_MARGIN + MEMORY_BASE)
    requests = {"cpu": str(max(1, cpus)), "memory": f"{max(1, math.ceil(memory / GiB))}Gi"}
    if not gpus:
        return {"requests": requests}
    return {"requests": {**requests, GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}


# -------------------------------------------------------------------------------------------- names and checks
def job_name(config) -> str:
    """A DNS-1035 name for the job from output.run_name (or output.dir's last folder): `ft-` and lower-case
    letters, digits and '-', shortened with a digest of the original to at most MAX_NAME characters."""
    original = config.output.run_name or Path(config.output.dir).name or "run"
    name = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]+", "-", original.lower())).strip("-")
    name = name if name.startswith("ft-") else f"ft-{name}".rstrip("-")
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(original.encode()).hexdigest()[:6]
        name = f"{name[: MAX_NAME - 7].rstrip('-')}-{digest}"
    return name


def check_options(image, kind, namespace, volume, secret) -> None:
    """The flags, before anything is planned: each problem names its flag."""
    if kind not in KINDS:
        raise FtError(f"kind {kind!r}: ft writes a pytorchjob (Kubeflow PyTorchJob) or a jobset (--jobset)")
    if not image or not str(image).strip() or any(c.isspace() for c in str(image)):
        raise FtError("--image: name the container image the pods run (one with ft installed), e.g. "
                      "--image registry.example.com/ft:0.1.0-cu128")  # fmt: skip
    flags = (("--namespace", namespace, DNS1123_LABEL, 63), ("--volume", volume, DNS1123_SUBDOMAIN, 253))
    for flag, value, pattern, limit in (*flags, ("--secret", secret, DNS1123_SUBDOMAIN, 253)):
        if value is not None and (len(str(value)) > limit or not re.fullmatch(pattern, str(value))):
            dots = "" if pattern == DNS1123_LABEL else " and '.'"
            raise FtError(f"{flag}: {value!r} is not a Kubernetes object name (lower-case letters, digits, '-'{dots}, "
                          f"starting and ending with a letter or digit; at most {limit} characters): give the name "
                          "of the object as kubectl shows it")  # fmt: skip


def check_output_dir(output_dir: str) -> None:
    """Every node reads the run folder node 0 writes, and a restarted pod resumes from it: it must be on the volume."""
    resolved = posixpath.normpath(posixpath.join(WORKDIR, str(output_dir)))
    if str(output_dir).startswith("~") or not resolved.startswith(WORKDIR + "/"):
        raise FtError(
            f"output.dir: {output_dir} is not on the shared volume the pods mount at {WORKDIR} (their working "
            f"directory): use a relative path such as runs/NAME (or one under {WORKDIR}/), so that every node "
            "sees the run folder and a restarted pod resumes from its checkpoints"
        )


def data_off_volume(config) -> list[str]:
    """Data paths the pods look for off the shared volume (absolute elsewhere, or in ~): found only if the image has
    them, so a warning each, not a refusal."""
    from finetune.data.sources import specs

    found = []
    for key, spec in specs(config):
        path = str(spec.path)
        if path.startswith("~") or (path.startswith("/") and not posixpath.normpath(path).startswith(WORKDIR + "/")):
            found.append(
                f"{key}.path: {path} is not on the shared volume the pods mount at {WORKDIR}; they find it only if "
                f"their image has it. Copy it to the volume and give a relative path (read from {WORKDIR})"
            )
    return found


def refuse_literal_secrets(config) -> None:
    """A secret written in clear in the job file or --set would travel in a ConfigMap or a command line."""
    from finetune.redaction import REDACTED, redact_config

    found = []

    def walk(value, at):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, [*at, k])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, [*at, i])
        elif isinstance(value, str) and REDACTED in value:
            found.append(".".join(str(p) for p in at))

    walk(redact_config(config, exclude_unset=True), [])
    if found:
        raise FtError(
            f"{', '.join(found)}: holds a secret in clear, which the manifest would carry in a ConfigMap or a "
            "command line. Put it in a Kubernetes Secret (kubectl create secret generic NAME --from-literal="
            "VAR=...), pass --secret NAME, and write ${VAR} in the job file instead"
        )


def refuse_leaks(text: str) -> None:
    """No value of a secret-named variable of this environment (HF_TOKEN, WANDB_API_KEY, ...) in the manifest."""
    from finetune.redaction import SECRET_KEY

    leaked = sorted(k for k, v in os.environ.items() if SECRET_KEY.search(k) and len(v) >= 8 and v in text)
    if leaked:
        raise FtError(
            f"the manifest would contain the value of {', '.join(leaked)} (typed into the job file or --set): "
            "write ${VAR} there instead and give the pods the variable through a Secret (--secret NAME)"
        )


# ------------------------------------------------------------------------------------------------- the YAML
def summary(plan) -> str:
    unit = "GPU" if plan.device == "GPU" else "CPU process"
    return (
        f"{plan.model}: {plan.method}, {plan.adapter}, {plan.backend}; {plan.nodes} node(s) x "
        f"{plan.processes_per_node} {unit}(s)"
    )


def header(plan, kind: str, secret: str | None, config) -> str:
    variables = sorted(config.env_variables())
    env = (
        f"the job file reads ${{{'}, ${'.join(variables)}}}: "
        + (f"the pods get it from the Secret {secret}" if secret else "give it with --secret NAME (a Secret)")
        if variables
        else "secrets (HF_TOKEN, WANDB_API_KEY) come from the Secret named by --secret, never from this file"
    )
    return (
        f"Written by `ft launch --k8s` ({'JobSet' if kind == 'jobset' else 'Kubeflow PyTorchJob'}): {summary(plan)}.\n"
        f"Apply with `kubectl apply -f FILE`; {env}.\n"
        f"Shared volume: PersistentVolumeClaim mounted at {WORKDIR} (run folder, checkpoints, HF cache).\n"
        f"Stop: SIGTERM, then {plan.stop_seconds} s to checkpoint; a signal's exit code restarts the job: it resumes."
    )


class Flow(list):
    """A list written on one line."""


def render(docs: list[dict], comment: str = "") -> str:
    """YAML of the documents, deterministic: keys in the order built, multi-line text as literal blocks."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):  # the same labels in several places are written out each time
            return True

    def text(dumper, value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    Dumper.add_representer(Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    body = yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=4096)
    return "".join(f"# {line}\n" for line in comment.splitlines()) + body
