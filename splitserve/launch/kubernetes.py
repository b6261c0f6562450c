"""Kubernetes manifests from a deployment file (``splitserve up CONFIG --emit kubernetes DIR``).

Runs in the ``splitserve`` CLI process; builds plain Python dicts and writes them with PyYAML,
one file per component plus a ``kustomization.yaml``. What each object is for, the drain timings
and how to apply them: docs/deployment.md, "Kubernetes".

This module assembles the output: the settings, the keys and their Secret, the files and the
kustomization. The objects come from one module per component, over what they share:
``kubernetes_engines.py`` (an engine pool: Service, Deployment, PodDisruptionBudget, the model),
``kubernetes_proxy.py`` (the proxy: ConfigMap, Deployment, Service) and
``kubernetes_common.py`` (names, labels, the keys volume, drain timings); the section's schema
is ``kubernetes_settings.py``, the engines' ``preStop`` hook ``kubernetes_drain.py``.

Invariants: generated keys appear only in the Secret (base64, as ``data`` requires); pods read
them from files mounted from it (``SPLITSERVE_AUTH_KEY_FILE``, the proxy's ``api_key_file`` and
``upstream_api_key_file``) or, for vLLM's API key, from an env var that references it. Every pod
of a pool runs the same command on the same ports (each pod has its own address); the proxy
finds them through the pool's headless Service (``discovery`` in its settings).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from splitserve.config import Deployment, DeploymentError
from splitserve.launch.kubernetes_common import (
    ENGINE_API_KEY,
    PROXY_API_KEY,
    SIDE_CHANNEL_KEY,
    ObjectContext,
    object_prefix,
)
from splitserve.launch.kubernetes_engines import engine_pool, gpus_per_server
from splitserve.launch.kubernetes_proxy import proxy_objects
from splitserve.launch.kubernetes_settings import KubernetesSettings
from splitserve.launch.secrets import needs_side_channel_key
from splitserve.transfer.auth import generate_key

__all__ = [
    "ENGINE_API_KEY",
    "FILES",
    "PROXY_API_KEY",
    "SIDE_CHANNEL_KEY",
    "Manifests",
    "build_manifests",
    "generate_keys",
    "gpus_per_server",
    "object_prefix",
    "settings_of",
]

FILES = ("secret.yaml", "prefill.yaml", "decode.yaml", "proxy.yaml")


class _Dumper(yaml.SafeDumper):
    """Plain YAML: a mapping used twice (labels, probes) is written out twice, no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    """A multi-line string (the proxy's YAML in its ConfigMap) as a literal block."""
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


@dataclass(frozen=True)
class Manifests:
    """Every file of the output directory: name -> the documents it holds."""

    files: dict[str, list[dict[str, Any]]]

    def write(self, out: Path) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for name, docs in self.files.items():
            path = out / name
            path.write_text(yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, width=100))
            written.append(path)
        return written

    def documents(self) -> list[dict[str, Any]]:
        return [
            d for name, docs in self.files.items() if name != "kustomization.yaml" for d in docs
        ]


def settings_of(dep: Deployment, source: str = "<config>") -> KubernetesSettings:
    """The ``kubernetes:`` section, validated; ``DeploymentError`` names each bad field."""
    from splitserve.proxy.config import describe_validation_error

    try:
        return KubernetesSettings.model_validate(dep.kubernetes)
    except ValidationError as e:
        raise DeploymentError(
            "\n".join(
                f"{source}: kubernetes.{line}" for line in describe_validation_error(e).splitlines()
            )
        ) from None


def secret(ctx: ObjectContext) -> dict[str, Any]:
    """The Secret every key is in (base64, as ``data`` requires)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": ctx.meta(ctx.secret_name, "keys"),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in ctx.keys.items()},
    }


def kustomization(k8s: KubernetesSettings) -> dict[str, Any]:
    """The ``kustomization.yaml``: the files, the namespace, and the image as an ``images``
    entry (so that ``kustomize edit set image`` can change it)."""
    image, _, tag = k8s.image.partition(":") if "@" not in k8s.image else (
        k8s.image, "", ""
    )  # fmt: skip
    data: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
    }
    if k8s.namespace:
        data["namespace"] = k8s.namespace
    data["resources"] = list(FILES)
    entry = {"name": image, "newName": image}
    if tag:
        entry["newTag"] = tag
    data["images"] = [entry]
    return data


def generate_keys(dep: Deployment) -> dict[str, str]:
    """Fresh keys for the Secret (a new emit makes new keys: docs/deployment.md)."""
    keys = {ENGINE_API_KEY: generate_key(), PROXY_API_KEY: generate_key()}
    if needs_side_channel_key(dep, ignore_key_file=True):
        keys = {SIDE_CHANNEL_KEY: generate_key(), **keys}
    return keys


def build_manifests(
    dep: Deployment, source: str = "<config>", keys: dict[str, str] | None = None
) -> Manifests:
    """Every manifest of ``dep`` (``keys``: the Secret's values; fresh ones by default).

    A deployment placed on hosts (``prefill.hosts`` ...) is refused: on Kubernetes the scheduler
    places pods and gives them their addresses, so host addresses would be silently dropped
    (and D's ``allowed_prefill_hosts`` derived from them would name nodes no pod has)."""
    if dep.placed:
        raise DeploymentError(
            f"{source}: prefill.hosts, decode.hosts and proxy.host place servers on machines "
            "for `splitserve up --host`; on Kubernetes the scheduler places the pods: remove "
            "them to emit manifests, and steer pools with kubernetes.node_selectors"
        )
    if dep.lmcache is not None:
        raise DeploymentError(
            f"{source}: lmcache: not emitted as Kubernetes manifests yet (the shared tier and "
            "the prefill pods' LMCache settings have no objects here); remove it to emit, or "
            "serve it with `splitserve up` (docs/lmcache.md)"
        )
    k8s = settings_of(dep, source)
    ctx = ObjectContext(dep, k8s, keys if keys is not None else generate_keys(dep))
    return Manifests(
        {
            "secret.yaml": [secret(ctx)],
            "prefill.yaml": engine_pool(ctx, "prefill"),
            "decode.yaml": engine_pool(ctx, "decode"),
            "proxy.yaml": proxy_objects(ctx),
            "kustomization.yaml": [kustomization(k8s)],
        }
    )
