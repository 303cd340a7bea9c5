"""Checks of the Kubernetes manifests `ft launch --k8s` writes, without a cluster, by existing validators:

- a PyTorchJob or JobSet: jsonschema over the openAPIV3Schema of the served version of its CRD, as its project
  publishes it (crds/, origins in crds/README.md). OpenAPI 3.0 schemas are JSON Schema Draft 4 with extensions;
  a field the schema does not declare is refused, as the API server's strict field validation (kubectl apply's
  default) refuses it.
- the ConfigMap: kubernetes-validate, against the strict schemas of Kubernetes' core API.

What only the API server and the operators' admission webhooks check (CEL rules, names they derive, replica rules)
is left to them; `kubectl apply --dry-run=server -f FILE` checks a manifest against a cluster's own.
"""

from __future__ import annotations

import functools
import gzip
import json
from importlib import resources

from finetune.errors import FtError

SCHEMAS = {  # (apiVersion, kind) -> file in crds/
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-v1.json.gz",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-v1alpha2.json.gz",
}
CORE = {("v1", "ConfigMap")}  # checked with kubernetes-validate
KUBERNETES = "1.30"  # the Kubernetes version whose core API schemas the ConfigMap is checked against


def schema_available() -> bool:
    """Whether jsonschema and kubernetes-validate (the `k8s` extra) are installed."""
    try:
        import jsonschema  # noqa: F401
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return False
    return True


def validate(doc: dict) -> None:
    """Raise FtError listing every problem of one manifest document, each with its JSONPath (`$` is the document)."""
    if not schema_available():
        raise FtError("checking a manifest needs jsonschema and kubernetes-validate: pip install 'finetune[k8s]'")
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in SCHEMAS:
        errors = list(crd_validator(SCHEMAS[key]).iter_errors(doc))
    elif key in CORE:
        errors = core_errors(doc)
    else:
        known = ", ".join(f"{v}/{k}" for v, k in (*SCHEMAS, *CORE))
        raise FtError(f"$.apiVersion/kind: {key[0]}/{key[1]} is not one ft writes ({known})")
    if errors:
        what = f"{key[1]} {(doc.get('metadata') or {}).get('name', '')}".strip()
        problems = sorted({f"{e.json_path}: {e.message}" for e in errors})
        raise FtError(f"{what} is not a valid Kubernetes manifest:\n  " + "\n  ".join(problems))


def core_errors(doc: dict) -> list:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as e:  # the first problem it finds
        return [e]
    return []


@functools.cache
def crd_validator(file: str):
    """A jsonschema validator of the CRD schema in crds/`file`."""
    import jsonschema

    data = json.loads(gzip.decompress((resources.files("finetune.launch") / "crds" / file).read_bytes()))
    return jsonschema.Draft4Validator(closed(data["openAPIV3Schema"]))


def closed(schema: dict) -> dict:
    """The schema with no fields but those it declares: `additionalProperties: false` where it lists `properties`
    and says nothing of other fields (the CRDs have no `x-kubernetes-preserve-unknown-fields`)."""
    out = {k: closed(v) if k in ("items", "additionalProperties", "not") and isinstance(v, dict) else v
           for k, v in schema.items()}  # fmt: skip
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [closed(s) for s in out[key]]
    if "properties" in out:
        out["properties"] = {k: closed(v) for k, v in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out
