"""Checks of the Kubernetes manifests `ft launch --k8s` writes, without a cluster.

- The CRD's own schema: the openAPIV3Schema of the served version of each CRD, as published by its project
  (finetune/launch/crds/, origins in its README.md), read with jsonschema's Draft 4 validator (OpenAPI 3.0
  schemas are Draft 4 with extensions) and the API server's rules for structural schemas: `nullable`,
  `x-kubernetes-int-or-string`, `format: int32/int64`, unique keys of `x-kubernetes-list-type: map/set` lists, and
  no unknown fields (the API server drops them, or refuses them under `kubectl apply`'s strict field validation).
  CEL rules (`x-kubernetes-validations`) are not evaluated: the ones in these CRDs compare an object with its
  previous version, or forbid combinations ft never writes.
- What the CRD schema leaves open and the API server or the operator's admission webhook checks: object names
  (DNS-1035 labels for jobs, and the names the operators derive from them), namespaces, labels and annotations,
  mounted volumes, the PyTorchJob webhook's replica rules (Training Operator v1.9.4,
  pkg/webhooks/pytorch/pytorchjob_webhook.go), the JobSet webhook's name and failure-policy rules (JobSet v0.12.0,
  pkg/webhooks/jobset_webhook.go) and the Job's pod failure policy rules.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections.abc import Iterator
from importlib import resources

from finetune.errors import FtError

SCHEMAS = {  # (apiVersion, kind) -> file in crds/
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-v1.json.gz",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-v1alpha2.json.gz",
}
CORE = {("v1", "ConfigMap")}
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")  # JobSet failure policy rule names
MAX_LABEL, MAX_SUBDOMAIN = 63, 253
MAX_ANNOTATIONS = 256 * 1024  # bytes of all annotations of an object
MAX_CONFIGMAP = 1024 * 1024  # bytes of a ConfigMap's data
OBJECT_META = {
    "annotations", "creationTimestamp", "deletionGracePeriodSeconds", "deletionTimestamp", "finalizers",
    "generateName", "generation", "labels", "managedFields", "name", "namespace", "ownerReferences",
    "resourceVersion", "selfLink", "uid",
}  # fmt: skip
JOB_FAILURE_REASONS = {
    "BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded", "PodFailurePolicy"
}  # fmt: skip
INSTALL = "pip install 'finetune[k8s]'"


def validate(doc: dict, schema: bool = True) -> None:
    """Raise FtError listing every problem of one manifest document, each with its path in the document (against
    the CRD schema too, unless schema=False)."""
    problems = list(problems_of(doc, schema))
    if problems:
        what = f"{doc.get('kind', 'document')} {(doc.get('metadata') or {}).get('name', '')}".strip()
        raise FtError(f"{what} is not a valid Kubernetes manifest:\n  " + "\n  ".join(problems))


def schema_available() -> bool:
    """Whether jsonschema (the `k8s` extra) is installed, to check manifests against the CRD schemas."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


def problems_of(doc: dict, schema: bool = True) -> Iterator[str]:
    """Each problem as 'path: what is wrong'."""
    if not isinstance(doc, dict):
        yield f"(document): expected a mapping, got {type(doc).__name__}"
        return
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in SCHEMAS and key not in CORE:
        known = ", ".join(f"{k} ({v})" for v, k in (*SCHEMAS, *CORE))
        yield f"apiVersion/kind: {key[0]}/{key[1]} is not one ft writes: {known}"
        return
    yield from _object_meta(doc.get("metadata"), "metadata", key[1])
    if key in CORE:
        yield from _config_map(doc)
        return
    if schema:
        yield from _schema_problems(doc, SCHEMAS[key])
    yield from (_pytorchjob if key[1] == "PyTorchJob" else _jobset)(doc)


# ----------------------------------------------------------------------------------------------- the CRD schema
def _schema_problems(doc: dict, file: str) -> Iterator[str]:
    found = {(path(e.absolute_path), e.message) for e in crd_validator(file).iter_errors(doc)}
    yield from (f"{where or '(document)'}: {message}" for where, message in sorted(found))


@functools.cache
def crd_validator(file: str):
    """A jsonschema validator of the CRD schema in crds/`file`, with the API server's structural-schema rules."""
    try:
        import jsonschema
    except ImportError:
        raise FtError(f"checking a manifest against the CRD schemas needs jsonschema: {INSTALL}") from None
    data = json.loads(gzip.decompress((resources.files("finetune.launch") / "crds" / file).read_bytes()))
    formats = jsonschema.FormatChecker(formats=())
    for name, bits in (("int32", 32), ("int64", 64)):
        formats.checks(name)(functools.partial(_fits, bits=bits))
    kinds = jsonschema.validators.extend(
        jsonschema.Draft4Validator,
        {"x-kubernetes-list-type": _list_type, "x-kubernetes-int-or-string": _int_or_string},
    )
    return kinds(structural(data["openAPIV3Schema"]), format_checker=formats)


def structural(schema: dict) -> dict:
    """The schema as the API server applies it: `nullable` admits null, and an object with `properties` (and no
    `additionalProperties` or `x-kubernetes-preserve-unknown-fields`) has no other fields."""
    out = dict(schema)
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out:
        out["properties"] = {k: structural(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = structural(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [structural(s) for s in out[key]]
    return out


def _fits(value, bits: int) -> bool:
    return not isinstance(value, int) or -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)


def _int_or_string(validator, value, instance, schema):
    from jsonschema import ValidationError

    if value and (isinstance(instance, bool) or not isinstance(instance, (int, str))):
        yield ValidationError(f"{instance!r} is neither an integer nor a string")


def _list_type(validator, value, instance, schema):
    """`map` lists: one item per value of the keys (e.g. env by name); `set` lists: no item twice."""
    from jsonschema import ValidationError

    if not isinstance(instance, list) or value not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen = set()
    for item in instance:
        ident = tuple(item.get(k) for k in keys) if value == "map" and isinstance(item, dict) else json.dumps(item)
        if ident in seen:
            yield ValidationError(f"duplicate entry {ident} (each of {', '.join(keys) or 'the items'} once)")
        seen.add(ident)


def path(parts) -> str:
    """A document path as `spec.replicas[0].limits["nvidia.com/gpu"]`."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{json.dumps(part)}]"
    return out


# ------------------------------------------------------------------------------------- names, labels, metadata
def name_problems(name, where: str, pattern=DNS1035, limit: int = MAX_LABEL) -> Iterator[str]:
    kind, rule = {
        DNS1035: ("a DNS-1035 label", "lower-case letters, digits and '-', starting with a letter"),
        DNS1123_LABEL: ("a DNS-1123 label", "lower-case letters, digits and '-', starting with a letter or digit"),
    }.get(pattern, ("a DNS-1123 subdomain", "lower-case letters, digits, '-' and '.'"))
    if not isinstance(name, str) or not name:
        yield f"{where}: required, {kind}"
    elif len(name) > limit or not pattern.fullmatch(name):
        yield f"{where}: {name!r} is not {kind} ({rule}, ending with a letter or digit; at most {limit} characters)"


def _object_meta(meta, where: str, kind: str, root: bool = True) -> Iterator[str]:
    if not isinstance(meta, dict):
        yield f"{where}: required, a mapping with the object's name" if root else f"{where}: expected a mapping"
        return
    for key in sorted(set(meta) - OBJECT_META):
        yield f"{where}.{key}: not a field of ObjectMeta"
    if root:
        pattern, limit = (DNS1123_SUBDOMAIN, MAX_SUBDOMAIN) if kind == "ConfigMap" else (DNS1035, MAX_LABEL)
        yield from name_problems(meta.get("name"), f"{where}.name", pattern, limit)
    if "namespace" in meta:
        yield from name_problems(meta["namespace"], f"{where}.namespace", DNS1123_LABEL)
    yield from _labels(meta.get("labels", {}), f"{where}.labels", values=True)
    yield from _labels(meta.get("annotations", {}), f"{where}.annotations", values=False)


def _labels(labels, where: str, values: bool) -> Iterator[str]:
    if not isinstance(labels, dict):
        yield f"{where}: expected a mapping of strings"
        return
    for key, value in labels.items():
        at = path([*where.split("."), key])
        prefix, _, name = str(key).rpartition("/")
        if prefix and (len(prefix) > MAX_SUBDOMAIN or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
            yield f"{at}: the prefix {prefix!r} is not a DNS-1123 subdomain"
        if len(name) > MAX_LABEL or not LABEL_NAME.fullmatch(name):
            yield f"{at}: {name!r} is not a valid key name (alphanumerics, '-', '_', '.'; at most 63 characters)"
        if not isinstance(value, str):
            yield f"{at}: {value!r} is not a string (quote it)"
        elif values and value and (len(value) > MAX_LABEL or not LABEL_NAME.fullmatch(value)):
            yield f"{at}: {value!r} is not a valid label value (alphanumerics, '-', '_', '.'; at most 63 characters)"
    if not values and sum(len(str(k)) + len(str(v)) for k, v in labels.items()) > MAX_ANNOTATIONS:
        yield f"{where}: more than {MAX_ANNOTATIONS} bytes in all"


def _config_map(doc: dict) -> Iterator[str]:
    for key in sorted(set(doc) - {"apiVersion", "kind", "metadata", "data", "binaryData", "immutable"}):
        yield f"{key}: not a field of ConfigMap"
    data = doc.get("data", {})
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        yield "data: expected a mapping of file names to strings"
        return
    for key in data:
        if len(key) > MAX_SUBDOMAIN or not CONFIG_KEY.fullmatch(key):
            yield f"{path(['data', key])}: not a valid file name (alphanumerics, '-', '_', '.')"
    if sum(len(k) + len(v.encode()) for k, v in data.items()) > MAX_CONFIGMAP:
        yield f"data: more than {MAX_CONFIGMAP} bytes, the most a ConfigMap holds"


# ------------------------------------------------------------------------------------------ the pod templates
def _pod(template, where: str) -> Iterator[str]:
    """A pod template: its labels, containers with an image, mounts of declared volumes."""
    if not isinstance(template, dict) or not isinstance(template.get("spec"), dict):
        return  # the schema says what is missing
    yield from _object_meta(template.get("metadata", {}), f"{where}.metadata", "Pod", root=False)
    spec = template["spec"]
    volumes = {v.get("name") for v in spec.get("volumes", []) if isinstance(v, dict)}
    for i, container in enumerate(spec.get("containers") or []):
        at = f"{where}.spec.containers[{i}]"
        if not isinstance(container, dict):
            continue
        if not str(container.get("image") or "").strip():
            yield f"{at}.image: required, the container image"
        for j, mount in enumerate(container.get("volumeMounts") or []):
            if isinstance(mount, dict) and mount.get("name") not in volumes:
                yield f"{at}.volumeMounts[{j}].name: {mount.get('name')!r} is not one of spec.volumes"


def _containers(template) -> list[dict]:
    spec = template.get("spec") if isinstance(template, dict) else None
    return [c for c in (spec or {}).get("containers") or [] if isinstance(c, dict)]


def _pytorchjob(doc: dict) -> Iterator[str]:
    """The Training Operator's admission rules, and the names it derives (`<name>-worker-<i>`: pods, services)."""
    specs = (doc.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    if not isinstance(specs, dict) or not specs:
        yield "spec.pytorchReplicaSpecs: required, with a Master replica"
        return
    name = str((doc.get("metadata") or {}).get("name", ""))
    for role, spec in specs.items():
        at = f"spec.pytorchReplicaSpecs.{role}"
        if role not in ("Master", "Worker"):
            yield f"{at}: the replica types are Master and Worker"
        if not isinstance(spec, dict):
            continue
        replicas = spec.get("replicas", 1)
        if role == "Master" and replicas != 1:
            yield f"{at}.replicas: must be 1"
        if role == "Worker" and isinstance(replicas, int):
            if replicas < 1:
                yield f"{at}.replicas: must be at least 1"
            yield from name_problems(f"{name}-worker-{replicas - 1}", f"{at} (its last pod's name)")
        yield from _pod(spec.get("template"), f"{at}.template")
        if not any(c.get("name") == "pytorch" for c in _containers(spec.get("template"))):
            yield f"{at}.template.spec.containers: needs a container named pytorch (the operator watches it)"


def _jobset(doc: dict) -> Iterator[str]:
    """The JobSet webhook's rules (names it derives, failure policy) and the Job's pod failure policy rules."""
    spec = doc.get("spec") or {}
    name = str((doc.get("metadata") or {}).get("name", ""))
    jobs = [j for j in spec.get("replicatedJobs") or [] if isinstance(j, dict)]
    for i, job in enumerate(jobs):
        at = f"spec.replicatedJobs[{i}]"
        yield from name_problems(job.get("name"), f"{at}.name")
        template = (job.get("template") or {}).get("spec") or {}
        last_job, last_pod = int(job.get("replicas", 1)) - 1, int(template.get("completions") or 1) - 1
        yield from name_problems(f"{name}-{job.get('name')}-{last_job}", f"{at} (its last Job's name)")
        pod_name = f"{name}-{job.get('name')}-{last_job}-{last_pod}-abcde"  # + the 5 characters Kubernetes adds
        yield from name_problems(pod_name, f"{at} (its last pod's name)")
        yield from _pod(template.get("template"), f"{at}.template.spec.template")
        yield from _pod_failure_policy(template, f"{at}.template.spec")
    names = {j.get("name") for j in jobs}
    for i, rule in enumerate((spec.get("failurePolicy") or {}).get("rules") or []):
        at = f"spec.failurePolicy.rules[{i}]"
        if not RULE_NAME.fullmatch(str(rule.get("name", ""))) or len(str(rule.get("name"))) > 128:
            yield f"{at}.name: {rule.get('name')!r} must match {RULE_NAME.pattern} (at most 128 characters)"
        for target in rule.get("targetReplicatedJobs") or []:
            if target not in names:
                yield f"{at}.targetReplicatedJobs: {target!r} is not one of spec.replicatedJobs"
        for reason in rule.get("onJobFailureReasons") or []:
            if reason not in JOB_FAILURE_REASONS:
                yield f"{at}.onJobFailureReasons: {reason!r} is not one of {', '.join(sorted(JOB_FAILURE_REASONS))}"


def _pod_failure_policy(job: dict, at: str) -> Iterator[str]:
    rules = (job.get("podFailurePolicy") or {}).get("rules") or []
    if not rules:
        return
    pod = job.get("template") or {}
    if (pod.get("spec") or {}).get("restartPolicy") != "Never":
        yield f"{at}.template.spec.restartPolicy: must be Never with a podFailurePolicy"
    names = {c.get("name") for c in _containers(pod)}
    for i, rule in enumerate(rules):
        codes = rule.get("onExitCodes") or {}
        where = f"{at}.podFailurePolicy.rules[{i}].onExitCodes"
        if codes.get("containerName") not in (None, *names):
            yield f"{where}.containerName: {codes['containerName']!r} is not a container of the pod"
        values = codes.get("values") or []
        if values != sorted(set(values)):
            yield f"{where}.values: must be sorted, each value once"
        if codes.get("operator") == "In" and 0 in values:
            yield f"{where}.values: 0 is not allowed with the In operator"
