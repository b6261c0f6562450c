"""The Kubernetes objects of the proxy: its settings in a ConfigMap, a Deployment, a Service.

Runs in the ``splitserve`` CLI process, called by ``kubernetes.build_manifests``. The proxy's
YAML is the deployment's ``proxy`` section with both pools found through their headless
Services (``discovery``), keys read from files of the mounted Secret, listening on every address
of its pod; it is validated here with the proxy's own ``ProxyConfig``, so a manifest the proxy
would refuse is never written. What each object is for: docs/deployment.md, "Kubernetes".

Invariants: generated keys reach the proxy only as paths into the mounted Secret
(``api_key_file``, ``upstream_api_key_file``), never as values in the ConfigMap; a key the
deployment file gives the proxy (``api_key``, ``api_key_file``) is left out.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from splitserve.config import DeploymentError
from splitserve.launch.deployment import proxy_port
from splitserve.launch.kubernetes_common import (
    DEFAULT_SIDE_CHANNEL_PORT,
    ENGINE_API_KEY,
    KEYS_DIR,
    PROXY_API_KEY,
    PROXY_CONFIG_DIR,
    SHUTDOWN_MARGIN_S,
    ObjectContext,
    scrape_annotations,
)


def proxy_settings(ctx: ObjectContext) -> dict[str, Any]:
    """The proxy's YAML: the deployment's ``proxy`` section, both pools found by DNS, keys
    from the mounted Secret, listening on every address of its pod."""
    from splitserve.proxy.config import ProxyConfig, describe_validation_error

    dep = ctx.dep
    prefill_dns: dict[str, Any] = {
        "name": f"{ctx.prefix}-prefill",
        "port": dep.prefill.base_port,
    }
    if dep.connector.name == "splitserve":
        prefill_dns["side_channel_port"] = (
            dep.prefill.side_channel_base_port or DEFAULT_SIDE_CHANNEL_PORT
        )
    data = {
        "flow": dep.flow,
        **{k: v for k, v in dep.proxy.items() if k not in ("api_key", "api_key_file")},
        "engine": dep.engine,
        "host": "0.0.0.0",
        "port": proxy_port(dep),
        "api_key_file": f"{KEYS_DIR}/{PROXY_API_KEY}",
        "upstream_api_key_file": f"{KEYS_DIR}/{ENGINE_API_KEY}",
        "prefill": [],
        "decode": [],
        "discovery": {
            "prefill": prefill_dns,
            "decode": {"name": f"{ctx.prefix}-decode", "port": dep.decode.base_port},
            "ttl_s": ctx.k8s.dns_ttl_s,
        },
    }
    try:
        ProxyConfig.model_validate(data)
    except ValidationError as e:
        raise DeploymentError(
            "\n".join(f"proxy.{line}" for line in describe_validation_error(e).splitlines())
        ) from None
    return data


def proxy_objects(ctx: ObjectContext) -> list[dict[str, Any]]:
    """The proxy's ConfigMap (its YAML), Deployment and Service."""
    k8s = ctx.k8s
    name = f"{ctx.prefix}-proxy"
    port = proxy_port(ctx.dep)
    labels = ctx.labels("proxy")
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": ctx.meta(name, "proxy"),
        "data": {"proxy.yaml": yaml.safe_dump(proxy_settings(ctx), sort_keys=False)},
    }
    probe = {"httpGet": {"path": "/health", "port": "http"}}
    res = k8s.resources.proxy
    container = {
        "name": "proxy",
        "image": k8s.proxy_image or k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": ["python", "-m", "splitserve.cli", "proxy", "--config",
                    f"{PROXY_CONFIG_DIR}/proxy.yaml"],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 6},
        # Clients' traffic leaves this pod (the Service's endpoints) before it stops.
        "lifecycle": {"preStop": {"sleep": {"seconds": ctx.drain_delay}}},
        "resources": {"requests": {"cpu": res.cpu, "memory": res.memory},
                      "limits": {"memory": res.memory}},
        "volumeMounts": [
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
            {"name": "config", "mountPath": PROXY_CONFIG_DIR, "readOnly": True},
        ],
    }  # fmt: skip
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": ctx.drain_delay + SHUTDOWN_MARGIN_S,
        "containers": [container],
        "volumes": [ctx.keys_volume(), {"name": "config", "configMap": {"name": name}}],
    }
    if k8s.node_selectors.proxy:
        pod_spec["nodeSelector"] = dict(k8s.node_selectors.proxy)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.meta(name, "proxy"),
        "spec": {
            "replicas": k8s.proxy_replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": scrape_annotations(port)},
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(name, "proxy"),
        "spec": {
            "type": k8s.proxy_service_type,
            "selector": labels,
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }
    return [config, deployment, service]
