"""What every Kubernetes object of one deployment shares: names, labels, the keys, drain timings.

Runs in the ``splitserve`` CLI process, while ``kubernetes.py`` builds the manifests. The engine
pools' objects (``kubernetes_engines.py``) and the proxy's (``kubernetes_proxy.py``) are built
from one ``ObjectContext``, so both name, label and mount things alike; it sits in a module of
its own so that neither imports the other nor the module that assembles them.

Invariants: every object's name starts with the deployment's prefix (``object_prefix``) and
carries the same three ``app.kubernetes.io`` labels; the keys are read from one Secret
(``secret_name``) mounted read-only at ``KEYS_DIR``.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ValidationError

from splitserve.config import Deployment, DeploymentError
from splitserve.launch.kubernetes_settings import KubernetesSettings

KEYS_DIR = "/etc/splitserve/keys"
PROXY_CONFIG_DIR = "/etc/splitserve/proxy"
MODELS_DIR = "/models"
SIDE_CHANNEL_KEY = "side-channel.key"
ENGINE_API_KEY = "engine-api.key"
PROXY_API_KEY = "proxy-api.key"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # a pool without side_channel_base_port (stock NIXL, decode)
SHUTDOWN_MARGIN_S = 30  # after the drain: the engine's own exit on SIGTERM


def object_prefix(dep: Deployment, k8s: KubernetesSettings) -> str:
    if k8s.name is not None:
        return k8s.name
    name = dep.name.lower().replace("_", "-").replace(".", "-").strip("-")
    try:
        KubernetesSettings(name=name)
    except ValidationError:
        raise DeploymentError(
            f"name: {dep.name!r} does not make Kubernetes object names; set kubernetes.name "
            "(lower-case letters, digits and '-', starting with a letter)"
        ) from None
    return name


class ObjectContext:
    """One deployment's settings, keys and the pieces its objects share."""

    def __init__(self, dep: Deployment, k8s: KubernetesSettings, keys: dict[str, str]) -> None:
        from splitserve.config import placeholder_side_ports, proxy_config_for

        self.dep = dep
        self.k8s = k8s
        self.keys = keys
        self.prefix = object_prefix(dep, k8s)
        self.secret_name = f"{self.prefix}-keys"
        # The proxy's timeouts bound how long a request may run: the engines' drain waits that.
        proxy = proxy_config_for(dep, placeholder_side_ports(dep))
        self.drain_delay = k8s.drain_delay_s()
        self.drain_timeout = int(math.ceil(k8s.drain_timeout_s or proxy.timeouts.total_s))

    def labels(self, component: str) -> dict[str, str]:
        return {
            "app.kubernetes.io/name": "splitserve",
            "app.kubernetes.io/instance": self.prefix,
            "app.kubernetes.io/component": component,
        }

    def meta(self, name: str, component: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "labels": self.labels(component), **extra}

    def keys_volume(self) -> dict[str, Any]:
        return {
            "name": "keys",
            "secret": {"secretName": self.secret_name, "defaultMode": 0o400},
        }

    @staticmethod
    def env_list(env: dict[str, str]) -> list[dict[str, Any]]:
        return [{"name": k, "value": v} for k, v in env.items()]


def scrape_annotations(port: int) -> dict[str, str]:
    """Prometheus' annotation-based discovery (the proxy's /metrics needs its key: see
    docs/deployment.md)."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
