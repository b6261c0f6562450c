"""Settings of the Kubernetes manifests: the deployment file's ``kubernetes:`` section.

Pure pydantic, validated when the manifests are written (``splitserve up CONFIG --emit
kubernetes DIR``); every error names the field and what Kubernetes accepts there. What the
manifests hold and why: docs/deployment.md, "Kubernetes".
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*(@sha256:[a-f0-9]{64})?$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_labels(labels: dict[str, str], what: str) -> dict[str, str]:
    """Kubernetes label keys (``[prefix/]name``) and values; ``ValueError`` naming the bad one."""
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or not (
            _LABEL_NAME.match(name)
        ):
            raise ValueError(
                f"{what}: {key!r} is not a label key ([prefix/]name: name up to 63 letters, "
                "digits, '-', '_', '.', starting and ending with a letter or digit)"
            )
        if value and not _LABEL_NAME.match(value):
            raise ValueError(
                f"{what}: the value {value!r} of {key!r} is not a label value (up to 63 "
                "letters, digits, '-', '_', '.', starting and ending with a letter or digit)"
            )
    return labels


class Resources(_Strict):
    """A pod's requests (the scheduler places it by them); memory is its limit too."""

    cpu: str = Field("2", description="CPU request, e.g. '2' or '1500m'.")
    memory: str = Field("8Gi", description="Memory request and limit, e.g. '8Gi'.")

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, v: str) -> str:
        if not _QUANTITY.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. '2', '500m', '8Gi')")
        return v


# Engine pods' defaults by device: a GPU server's host process still loads and stages weights.
ENGINE_DEFAULTS = {
    "cpu": Resources(cpu="2", memory="8Gi"),
    "gpu": Resources(cpu="8", memory="64Gi"),
}


class PerComponent(_Strict):
    """Each component's pod resources; an engine pool left unset gets ``ENGINE_DEFAULTS`` of
    the deployment's device."""

    prefill: Resources | None = None
    decode: Resources | None = None
    proxy: Resources = Resources(cpu="1", memory="1Gi")


class NodeSelectors(_Strict):
    """``nodeSelector`` of each component's pods (e.g. a GPU node pool for the engines)."""

    prefill: dict[str, str] = Field(default_factory=dict)
    decode: dict[str, str] = Field(default_factory=dict)
    proxy: dict[str, str] = Field(default_factory=dict)

    @field_validator("prefill", "decode", "proxy")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v, "node selector")


class KubernetesSettings(_Strict):
    """The ``kubernetes:`` section of a deployment file; every field has a default."""

    name: str | None = Field(
        None, description="Prefix of every object's name (a DNS label); default: the "
        "deployment's name, lower-cased, '_' and '.' turned to '-'.",
    )  # fmt: skip
    namespace: str | None = Field(
        None, description="Written to kustomization.yaml (objects carry none of their own)."
    )
    image: str = Field(
        "splitserve:latest",
        description="Engine image: Python with splitserve and the engine installed, "
        "'python' on its PATH.",
    )
    proxy_image: str | None = Field(None, description="Proxy image; default: image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    node_selectors: NodeSelectors = NodeSelectors()
    resources: PerComponent = PerComponent()
    gpu_resource: str = Field(
        "nvidia.com/gpu", description="Extended resource a GPU engine pod asks for (one per "
        "GPU of its tensor x pipeline parallel group).",
    )  # fmt: skip
    proxy_replicas: int = Field(1, ge=1, le=100)
    proxy_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    model_path: str | None = Field(
        None, description="The model inside the engine containers; default: the deployment's "
        "model.path, or for a preset the directory an init container builds.",
    )  # fmt: skip
    model_claim: str | None = Field(
        None, description="A PersistentVolumeClaim mounted read-only at /models (with "
        "model_path under it).",
    )  # fmt: skip
    dns_ttl_s: float = Field(
        5.0, gt=0, le=300, description="How often the proxy resolves the pools' headless "
        "Services again (its discovery.ttl_s).",
    )  # fmt: skip
    cluster_dns_ttl_s: float = Field(
        5.0, ge=0, le=300, description="The cluster DNS's own TTL for Service records "
        "(CoreDNS's kubernetes plugin: 5 s unless configured).",
    )  # fmt: skip
    drain_timeout_s: float | None = Field(
        None, gt=0, le=86400, description="Longest an engine being removed waits for its "
        "in-flight requests; default: the proxy's timeouts.total_s.",
    )  # fmt: skip

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 40 or not _DNS_LABEL.match(v)):
            raise ValueError(
                f"{v!r}: lower-case letters, digits and '-', starting with a letter, at most 40 "
                "characters (object names add a suffix)"
            )
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and not _DNS_LABEL.match(v):
            raise ValueError(f"{v!r} is not a namespace name (a lower-case DNS label)")
        return v

    @field_validator("image", "proxy_image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not _IMAGE.match(v):
            raise ValueError(
                f"{v!r} is not an image reference (e.g. registry.example/splitserve:0.1)"
            )
        return v

    @field_validator("gpu_resource")
    @classmethod
    def _resource(cls, v: str) -> str:
        prefix, _, name = v.rpartition("/")
        if not prefix or not _DNS_SUBDOMAIN.match(prefix) or not _LABEL_NAME.match(name):
            raise ValueError(f"{v!r} is not an extended resource name (e.g. nvidia.com/gpu)")
        return v

    def drain_delay_s(self) -> int:
        """How long a pod being removed keeps serving before it drains: the cluster DNS's TTL
        plus one proxy resolution, plus 5 s for the endpoints to be updated (docs/deployment.md,
        "Drain timings")."""
        return int(self.cluster_dns_ttl_s + self.dns_ttl_s + 5 + 0.999)
