"""Kubernetes: the manifests `ft launch --k8s` writes (Kubeflow PyTorchJob, JobSet) validate against the published CRD
schemas ft ships (the ConfigMap against Kubernetes' core schemas), for plans of 1 node x 1 GPU, 1 x 8 and 4 x 8;
replicas, GPUs and the grace period follow the plan; no secret value is written; each pod's command is `ft train`
with the node's place taken from the operator's variables, without the RANK/WORLD_SIZE that would make ft take itself
for a torchrun rank. Golden manifests in tests/data/k8s/ hold what ft writes for a few jobs; after an intended
change, regenerate them with `FT_UPDATE_GOLDEN=1 python -m pytest tests/test_k8s.py -k golden` and review the diff.
No cluster runs here."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex

import pytest
import typer
import yaml

from finetune.errors import FtError
from finetune.hardware import launch_env
from finetune.launch import k8s
from finetune.launch.k8s_schema import SCHEMAS, validate
from finetune.workflow import NodeRole, compile_plan
from tests.helpers import MINIMAL, REPO

JOB = str(REPO / "examples/yaml/llama3.1-8b-full-8xh100.yaml")
QUICKSTART = str(REPO / "examples/yaml/quickstart.yaml")
PLANS = [("1xH100", 1, 1), ("8xH100", 1, 8), ("4x8xH100", 4, 8)]  # (hardware, nodes, GPUs per node)
HF = "hf_" + "k8s" * 12  # looks like a Hugging Face token
WANDB = "0123456789abcdef" * 2 + "01234567"  # a wandb key: 40 hex digits
GOLDEN = REPO / "tests/data/k8s"
CLUSTER = {"namespace": "ml-team", "volume": "shared-runs", "secret": "ft-secrets"}
GOLDEN_JOBS = {  # file -> kind, hardware (a CPU's cores and memory given, not this machine's), job, options
    "pytorchjob-1xH100.yaml": ("pytorchjob", "1xH100", JOB, {}),
    "pytorchjob-4x8xH100.yaml": ("pytorchjob", "4x8xH100", JOB, CLUSTER),
    "jobset-4x8xH100.yaml": ("jobset", "4x8xH100", JOB, CLUSTER),
    "jobset-cpu-2.yaml": ("jobset", "cpu:2,cpus=4,host=32GiB", QUICKSTART, {}),
}


@pytest.fixture(autouse=True)
def workdir(tmp_path, monkeypatch):
    """ft launch reads the job's data paths as ft validate does, from the working directory (the pods read the same
    relative paths on the volume): one with MINIMAL's data/train.jsonl and the examples' data."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"messages": []}\n')
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)


def write(tmp_path, kind="pytorchjob", hardware="4x8xH100", job=JOB, overrides=(), **options):
    out = tmp_path / f"{kind}-{hardware}.yaml"
    options.setdefault("image", "registry.example.com/ft:0.1.0-cu128")
    path = k8s.write_manifest(job, overrides, hardware, out, kind=kind, **options)
    assert path == out
    return out.read_text(), list(yaml.safe_load_all(out.read_text()))


def pod_spec(job: dict) -> dict:
    """The pod template's spec of node 0 (PyTorchJob Master, or the JobSet's one Indexed Job)."""
    if job["kind"] == "PyTorchJob":
        return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("kind", k8s.KINDS)
@pytest.mark.parametrize("hardware,nodes,gpus", PLANS)
def test_manifests_validate_and_follow_the_plan(tmp_path, kind, hardware, nodes, gpus):
    plan = compile_plan(JOB, (), hardware)
    assert (plan.nodes, plan.processes_per_node) == (nodes, gpus)
    _, docs = write(tmp_path, kind, hardware, namespace="ml-team", volume="shared-runs", secret="ft-secrets")
    for doc in docs:
        validate(doc)  # the CRD schema, names and labels, the operator's own rules
    config_map, job = docs
    assert config_map["data"]["job.yaml"] == (REPO / "examples/yaml/llama3.1-8b-full-8xh100.yaml").read_text()
    assert {d["metadata"]["namespace"] for d in docs} == {"ml-team"}
    spec = pod_spec(job)
    assert spec["terminationGracePeriodSeconds"] == plan.stop_seconds > 0
    (container,) = spec["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": str(gpus)}
    assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
    assert 1 <= int(container["resources"]["requests"]["cpu"]) <= plan.cpus_per_node
    assert container["envFrom"] == [{"secretRef": {"name": "ft-secrets"}}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shared"]["persistentVolumeClaim"] == {"claimName": "shared-runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert volumes["job"]["configMap"]["name"] == config_map["metadata"]["name"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/data": "shared", "/etc/ft": "job", "/dev/shm": "dshm"} and container["workingDir"] == "/data"
    assert {"name": "HF_HOME", "value": "/data/.cache/huggingface"} in container["env"]
    if kind == "pytorchjob":
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] == 1
        assert replicas.get("Worker", {}).get("replicas", 0) == nodes - 1
        assert {r["restartPolicy"] for r in replicas.values()} == {"ExitCode"}  # 128+: restart; 1-127: fail
        assert job["spec"]["nprocPerNode"] == str(gpus)
    else:
        indexed = job["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert indexed["parallelism"] == indexed["completions"] == nodes and indexed["completionMode"] == "Indexed"
        assert indexed["backoffLimit"] == 0 and spec["restartPolicy"] == "Never"
        (rule,) = indexed["podFailurePolicy"]["rules"]
        assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == list(range(1, 128))
        policy = job["spec"]["failurePolicy"]
        assert policy["maxRestarts"] > 0 and policy["rules"][0]["action"] == "FailJobSet"


def test_cpu_plans_ask_for_no_gpu(tmp_path):
    text, docs = write(tmp_path, "jobset", "cpu:2", job=str(REPO / "examples/yaml/quickstart.yaml"))
    for doc in docs:
        validate(doc)
    spec = pod_spec(docs[1])
    assert "nvidia.com/gpu" not in text and "tolerations" not in spec
    assert spec["containers"][0]["resources"]["requests"]["cpu"] == "2"
    # the pods plan for the hardware the manifest was planned for: the same 2 processes
    assert shlex.split(spec["containers"][0]["command"][2])[-2:] == ["--hardware", "cpu:2"]


@pytest.mark.parametrize("file", GOLDEN_JOBS)
def test_manifests_match_the_golden_files(tmp_path, file):
    kind, hardware, job, options = GOLDEN_JOBS[file]
    text, _ = write(tmp_path, kind, hardware, job=job, **options)
    if os.environ.get("FT_UPDATE_GOLDEN") == "1":
        (GOLDEN / file).write_text(text)
    assert text == (GOLDEN / file).read_text(), f"{file} differs; if intended: FT_UPDATE_GOLDEN=1 (module docstring)"


@pytest.mark.parametrize("file", GOLDEN_JOBS)
def test_golden_manifests_validate(file):
    docs = list(yaml.safe_load_all((GOLDEN / file).read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "JobSet" if file.startswith("jobset") else "PyTorchJob"]
    for doc in docs:
        validate(doc)


def test_a_broken_manifest_is_refused_with_each_path():
    config_map, job = yaml.safe_load_all((GOLDEN / "pytorchjob-4x8xH100.yaml").read_text())
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    worker["replicas"] = "three"
    container = worker["template"]["spec"]["containers"][0]
    container["resources"]["requests"]["cpu"] = "lots"
    container["imagePullPolicyy"] = "Always"  # a typo: the API server would drop it, or refuse it (strict)
    job["spec"]["nprocPerNode"] = 8  # a string in the CRD
    with pytest.raises(FtError) as e:
        validate(job)
    message = str(e.value)
    at = "$.spec.pytorchReplicaSpecs.Worker"
    for where in (
        f"{at}.replicas: 'three' is not of type 'integer'",
        f"{at}.template.spec.containers[0].resources.requests.cpu: 'lots' does not match",
        f"{at}.template.spec.containers[0]: Additional properties are not allowed ('imagePullPolicyy' was unexpected)",
        "$.spec.nprocPerNode: 8 is not of type 'string'",
    ):
        assert where in message, message
    assert message.startswith("PyTorchJob ft-llama3-1-8b-full is not a valid Kubernetes manifest")
    _, jobset = yaml.safe_load_all((GOLDEN / "jobset-4x8xH100.yaml").read_text())
    jobset["spec"]["replicatedJobs"][0]["replica"] = 1
    with pytest.raises(FtError, match=re.escape("$.spec.replicatedJobs[0]: Additional properties are not allowed")):
        validate(jobset)
    config_map["data"]["job.yaml"] = 3
    with pytest.raises(FtError, match=re.escape("$.data['job.yaml']: 3 is not of type 'string'")):
        validate(config_map)
    with pytest.raises(FtError, match="apps/v1/Deployment is not one ft writes"):
        validate({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}})


def test_no_secret_value_is_written(tmp_path, write_yaml, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", HF)
    monkeypatch.setenv("WANDB_API_KEY", WANDB)
    text, docs = write(tmp_path, "jobset", secret="ft-secrets")
    assert HF not in text and WANDB not in text and "HF_TOKEN" not in json.dumps(docs[1])
    # a job file that reads a secret keeps the reference; the pods read the variable from the Secret
    job = write_yaml(MINIMAL.replace("meta-llama/Llama-3.1-8B}", 'meta-llama/Llama-3.1-8B, revision: "${HF_TOKEN}"}'))
    text, docs = write(tmp_path, "pytorchjob", job=str(job), secret="ft-secrets")
    assert HF not in text and "${HF_TOKEN}" in docs[0]["data"]["job.yaml"] and "Secret ft-secrets" in text
    # one written in clear (in the file, or with --set) is refused rather than put in a ConfigMap or a command line
    with pytest.raises(FtError, match=r"model.revision: holds a secret in clear.*--secret NAME"):
        write(tmp_path, job=str(job), overrides=(f"model.revision={HF}",))
    leaky = write_yaml(MINIMAL.replace("runs/llama8b-lora", f"runs/{WANDB[:16]}"), name="leaky.yaml")
    monkeypatch.setenv("MY_SERVICE_PASSWORD", WANDB[:16])  # not recognisable as a secret, but the variable says so
    with pytest.raises(FtError, match="the manifest would contain the value of MY_SERVICE_PASSWORD"):
        write(tmp_path, job=str(leaky))


def operator_env(kind: str, name: str, node_rank: int, nodes: int, gpus: int) -> dict[str, str]:
    """What a pod of node `node_rank` finds in its environment: the Training Operator's variables (envvar.go and
    master.go at v1.9.4: a Worker of index i has RANK i+1), or the Indexed Job's completion index (JobSet)."""
    if kind == "jobset":
        return {"JOB_COMPLETION_INDEX": str(node_rank)}
    master = f"{name}-master-0"
    return {
        "PYTHONUNBUFFERED": "1", "MASTER_PORT": "29500", "PET_MASTER_PORT": "29500", "MASTER_ADDR": master,
        "PET_MASTER_ADDR": master, "WORLD_SIZE": str(nodes * gpus), "RANK": str(node_rank),
        "PET_NODE_RANK": str(node_rank), "PET_NPROC_PER_NODE": str(gpus), "PET_NNODES": str(nodes),
    }  # fmt: skip


@pytest.mark.parametrize("kind", k8s.KINDS)
def test_each_pod_runs_ft_train_as_its_node(tmp_path, kind, monkeypatch):
    _, (_, job) = write(tmp_path, kind, overrides=("train.epochs=1",))
    container = pod_spec(job)["containers"][0]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    argv = shlex.split(container["command"][2])
    assert argv[:2] == ["exec", "env"]  # exec: ft itself receives the pod's SIGTERM
    unset = [argv[i + 1] for i in range(2, len(argv)) if argv[i] == "-u"]
    assert {"RANK", "WORLD_SIZE", "PET_NODE_RANK"} <= set(unset)
    ft = argv[2 + 2 * len(unset) :]
    name = job["metadata"]["name"]
    # ft's images start ft through ft-entrypoint (the GPU check, the kernel cache per CPU); other images: ft
    assert ft[0] == "$(command -v ft-entrypoint || echo ft)"
    assert ft[1:3] == ["train", "/etc/ft/job.yaml"] and "--hardware" not in ft  # GPUs: ft probes the pod
    assert " ".join(ft).count("--set") == 2 and "train.epochs=1" in ft and ft[-1] == name
    assert ft[ft.index("output.resume=auto") - 1] == "--set"  # a restarted pod resumes from the newest checkpoint

    pod = {**{e["name"]: e["value"] for e in container["env"]}, **operator_env(kind, name, 2, 4, 8)}
    assert launch_env(pod).launcher == ("torchrun" if kind == "pytorchjob" else "none")  # the trap the command avoids
    for key in pod:
        monkeypatch.setenv(key, pod[key])
    for key in unset:
        monkeypatch.delenv(key, raising=False)
    expanded = [re.sub(r"\$(\w+)", lambda m: pod[m.group(1)], a) for a in ft]  # what the pod's shell passes
    assert launch_env().launcher == "none"
    from finetune.cli import app

    params = typer.main.get_command(app).commands["train"].make_context("train", expanded[2:]).params
    role = NodeRole.from_env(params["nnodes"], params["node_rank"], params["master_addr"], params["master_port"],
                             params["rdzv_id"])  # fmt: skip
    address = f"{name}-master-0" if kind == "pytorchjob" else f"{name}-node-0-0.{name}"
    assert role == NodeRole(nnodes=4, node_rank=2, master_addr=address, master_port=29500, rdzv_id=name)
    assert params["set_"] == ["train.epochs=1", "output.resume=auto"]


def test_names_are_valid_and_stable(tmp_path, write_yaml):
    job = write_yaml(MINIMAL.replace("runs/llama8b-lora", "runs/My_Run.v2 (final) of the Llama-3.1 8B LoRA sweep"))
    text, docs = write(tmp_path, "jobset", job=str(job))
    name = docs[1]["metadata"]["name"]
    assert re.fullmatch(r"ft-[a-z0-9-]+[a-z0-9]", name) and len(name) <= k8s.MAX_NAME, name
    for doc in docs:
        validate(doc)
    assert write(tmp_path, "jobset", job=str(job))[0] == text  # deterministic: the same bytes again
    named = write_yaml(MINIMAL.replace("{dir: runs/llama8b-lora}", "{dir: runs/x, run_name: Sweep_7}"), name="n.yaml")
    assert write(tmp_path, job=str(named))[1][1]["metadata"]["name"] == "ft-sweep-7"


def test_options_and_output_dir_are_checked(tmp_path, write_yaml):
    for options, flag in (
        ({"image": ""}, "--image"),
        ({"image": None}, "--image"),
        ({"namespace": "ML_Team"}, "--namespace"),
        ({"volume": "bad volume"}, "--volume"),
        ({"kind": "deployment"}, "jobset (--jobset)"),
    ):
        with pytest.raises(FtError, match=re.escape(flag)):
            write(tmp_path, **options)
    outside = write_yaml(MINIMAL.replace("runs/llama8b-lora", "/scratch/runs/x"))
    with pytest.raises(FtError, match=r"output.dir: /scratch/runs/x is not on the shared volume .* /data"):
        write(tmp_path, job=str(outside))


def test_ft_launch_refuses_what_ft_validate_refuses_and_warns_of_data_off_the_volume(tmp_path, write_yaml, capsys):
    from finetune.workflow import check_job

    missing = write_yaml(MINIMAL.replace("data/train.jsonl", "data/missing.jsonl"), name="missing.yaml")
    with pytest.raises(FtError) as validated:
        check_job(missing)
    with pytest.raises(FtError) as launched:
        write(tmp_path, job=str(missing))
    assert str(launched.value) == str(validated.value) and "data.datasets[0].path: data file not found" in str(
        launched.value
    )
    assert not list(tmp_path.glob("pytorchjob-*.yaml"))
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text('{"messages": []}\n')
    write(tmp_path, job=str(write_yaml(MINIMAL.replace("data/train.jsonl", str(outside)), name="abs.yaml")))
    assert f"data.datasets[0].path: {outside} is not on the shared volume the pods mount at /data" in (
        capsys.readouterr().err
    )


def test_shipped_schemas_record_their_origin():
    readme = (REPO / "finetune/launch/crds/README.md").read_text()
    for (api_version, kind), file in SCHEMAS.items():
        data = json.loads(gzip.decompress((REPO / "finetune/launch/crds" / file).read_bytes()))
        assert (data["apiVersion"], data["kind"]) == (api_version, kind)
        assert data["origin"]["license"] == "Apache-2.0" and data["origin"]["tag"] in readme and file in readme
        assert data["openAPIV3Schema"]["properties"]["spec"]["type"] == "object"


def test_without_jsonschema_the_manifest_is_written_unchecked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("finetune.launch.k8s.schema_available", lambda: False)
    _, docs = write(tmp_path, "jobset")
    assert len(docs) == 2 and "pip install 'finetune[k8s]'" in capsys.readouterr().err
