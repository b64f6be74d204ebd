"""deploy/k8s/ checked offline (no cluster here): every manifest parses, names a known
apiVersion and kind, carries what the Gateway API Inference Extension v1 requires of an
InferencePool, and refers to the others consistently; the picker's environment is a
configuration the guard accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from guard_adapters.config import load_config

K8S = Path(__file__).parents[2] / "deploy/k8s"
KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
}


def documents() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            assert isinstance(document, dict), path
            key = (document.get("apiVersion"), document.get("kind"))
            assert key in KINDS, f"{path.name}: unknown {key}"
            name = document["metadata"]["name"]
            assert isinstance(name, str)
            assert name
            found[f"{document['kind']}/{name}"] = document
    return found


def port_number(value: Any) -> int:
    assert isinstance(value, int)
    assert 1 <= value <= 65535
    return value


def test_the_manifests_parse_and_name_known_kinds() -> None:
    kinds = {key.partition("/")[0] for key in documents()}
    assert kinds == {"InferencePool", "Gateway", "HTTPRoute", "Deployment", "Service"}


def test_the_inference_pool_has_what_v1_requires() -> None:
    pool = documents()["InferencePool/qwen-pool"]["spec"]
    labels = pool["selector"]["matchLabels"]
    assert labels
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    assert len(pool["targetPorts"]) == 1
    port_number(pool["targetPorts"][0]["number"])
    picker = pool["endpointPickerRef"]
    assert picker.get("kind", "Service") == "Service"
    assert picker["failureMode"] in ("FailOpen", "FailClose")
    port_number(picker["port"]["number"])
    assert set(pool) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}


def test_the_route_the_pool_and_the_picker_refer_to_each_other() -> None:
    found = documents()
    route = found["HTTPRoute/qwen-route"]["spec"]
    assert route["parentRefs"][0]["name"] == "inference-gateway"
    assert "Gateway/inference-gateway" in found
    backend = route["rules"][0]["backendRefs"][0]
    assert backend["group"] == "inference.networking.k8s.io"
    assert backend["kind"] == "InferencePool"
    pool = found[f"InferencePool/{backend['name']}"]["spec"]
    picker_ref = pool["endpointPickerRef"]
    service = found[f"Service/{picker_ref['name']}"]["spec"]
    grpc_port = next(p for p in service["ports"] if p["port"] == picker_ref["port"]["number"])
    deployment = found[f"Deployment/{picker_ref['name']}"]["spec"]
    assert service["selector"].items() <= deployment["template"]["metadata"]["labels"].items()
    container = deployment["template"]["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    target = named[grpc_port["targetPort"]]
    env = {e["name"]: e.get("value", "secret") for e in container["env"]}
    assert env["PIG_EPP_LISTEN"].rpartition(":")[2] == str(target)
    for probe, service_name in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        assert container[probe]["grpc"] == {"port": target, "service": service_name}
    assert deployment["replicas"] == 1  # one picker owns the pool's cap


def test_the_pickers_environment_is_a_configuration_the_guard_accepts() -> None:
    deployment = documents()["Deployment/inference-guard-epp"]["spec"]
    container = deployment["template"]["spec"]["containers"][0]
    assert container["args"] == ["epp"]
    env = {e["name"]: e.get("value", "a-secret-token") for e in container["env"]}
    settings = load_config(env)
    assert settings.epp_listen == ("0.0.0.0", 9002)
    assert len(settings.backends) == 2
    assert settings.guard_routing
