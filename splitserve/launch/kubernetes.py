"""Kubernetes manifests from a deployment file (``splitserve up CONFIG --emit kubernetes DIR``).

Runs in the ``splitserve`` CLI process; builds plain Python dicts and writes them with PyYAML,
one file per component plus a ``kustomization.yaml``. The engines' command lines come from
``splitserve.launch.deployment.server_command``, the code ``splitserve up`` runs, with the pod's
addresses instead of loopback. What each object is for, the drain timings and how to apply them:
docs/deployment.md, "Kubernetes".

Invariants: generated keys appear only in the Secret (base64, as ``data`` requires); pods read
them from files mounted from it (``SPLITSERVE_AUTH_KEY_FILE``, the proxy's ``api_key_file`` and
``upstream_api_key_file``) or, for vLLM's API key, from an env var that references it. Every pod
of a pool runs the same command on the same ports (each pod has its own address); the proxy
finds them through the pool's headless Service (``discovery`` in its settings).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from splitserve.config import Deployment, DeploymentError, PoolSettings
from splitserve.launch.deployment import proxy_port, server_command
from splitserve.launch.kubernetes_settings import ENGINE_DEFAULTS, KubernetesSettings
from splitserve.launch.secrets import ENGINE_API_KEY_ENV, needs_side_channel_key
from splitserve.models import PRESETS, ModelSpec
from splitserve.transfer.auth import KEY_FILE_ENV, generate_key

KEYS_DIR = "/etc/splitserve/keys"
PROXY_CONFIG_DIR = "/etc/splitserve/proxy"
MODELS_DIR = "/models"
SIDE_CHANNEL_KEY = "side-channel.key"
ENGINE_API_KEY = "engine-api.key"
PROXY_API_KEY = "proxy-api.key"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # a pool without side_channel_base_port (stock NIXL, decode)
SHUTDOWN_MARGIN_S = 30  # after the drain: the engine's own exit on SIGTERM
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


class _Builder:
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

    # ------------------------------------------------------------------ shared pieces

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

    # ------------------------------------------------------------------ Secret

    def secret(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self.meta(self.secret_name, "keys"),
            "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in self.keys.items()},
        }

    # ------------------------------------------------------------------ engine pools

    def model(self) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """The model path in the container, init containers that build it, and its volume."""
        dep, k8s = self.dep, self.k8s
        volume: dict[str, Any] = (
            {
                "name": "models",
                "persistentVolumeClaim": {"claimName": k8s.model_claim, "readOnly": True},
            }
            if k8s.model_claim
            else {"name": "models", "emptyDir": {}}
        )
        if dep.model.path is not None:
            return k8s.model_path or dep.model.path, [], volume
        assert dep.model.preset is not None
        spec = ModelSpec(**{**PRESETS[dep.model.preset].model_dump(), **dep.model.shape})
        path = k8s.model_path or f"{MODELS_DIR}/{dep.model.preset}-seed{spec.seed}"
        init = {
            "name": "build-model",
            "image": k8s.image,
            "imagePullPolicy": k8s.image_pull_policy,
            "command": ["python", "-m", "splitserve.cli", "model", "build", "--preset",
                        dep.model.preset, "--out", path, *_shape_flags(dep.model.shape)],
            "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}],
        }  # fmt: skip
        return path, [init], volume

    def pool(self, role: str) -> list[dict[str, Any]]:
        dep, k8s = self.dep, self.k8s
        pool: PoolSettings = getattr(dep, role)
        name = f"{self.prefix}-{role}"
        port = pool.base_port
        side = pool.side_channel_base_port or DEFAULT_SIDE_CHANNEL_PORT
        model, init, model_volume = self.model()
        key_env = {}
        if SIDE_CHANNEL_KEY in self.keys:
            key_env[KEY_FILE_ENV] = f"{KEYS_DIR}/{SIDE_CHANNEL_KEY}"
        dep_for_pod = _without_local_key_file(dep)
        cmd = server_command(
            dep_for_pod, role, model, port, side, host="0.0.0.0", side_host="$(POD_IP)",
            env={**pool.env, **key_env}, python="python",
        )  # fmt: skip
        env = [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {
                "name": ENGINE_API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": self.secret_name, "key": ENGINE_API_KEY}},
            },
            *self.env_list(cmd.env),
        ]
        res = getattr(k8s.resources, role) or ENGINE_DEFAULTS[dep.device]
        requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
        limits: dict[str, Any] = {"memory": res.memory}
        volumes = [self.keys_volume(), model_volume]
        mounts = [
            {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
            {"name": "models", "mountPath": MODELS_DIR},
        ]
        if dep.device == "gpu":
            gpus = gpus_per_server(pool)
            requests[k8s.gpu_resource] = gpus
            limits[k8s.gpu_resource] = gpus
            # Tensor parallel workers share tensors through /dev/shm (64 MiB by default).
            volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
            mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        probe = {"httpGet": {"path": "/health", "port": "http"}}
        startup_checks = int(math.ceil(dep.startup_timeout_s / 10))
        container = {
            "name": "vllm",
            "image": k8s.image,
            "imagePullPolicy": k8s.image_pull_policy,
            "command": cmd.argv,
            "env": env,
            "ports": [
                {"name": "http", "containerPort": port},
                {"name": "side-channel", "containerPort": side},
            ],
            "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": startup_checks},
            "readinessProbe": {**probe, "periodSeconds": 5, "timeoutSeconds": 5,
                               "failureThreshold": 3},
            "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 10,
                              "failureThreshold": 6},
            "lifecycle": {"preStop": {"exec": {"command": [
                "python", "-m", "splitserve.launch.kubernetes_drain", "--port", str(port),
                "--delay-s", str(self.drain_delay), "--timeout-s", str(self.drain_timeout),
            ]}}},
            "resources": {"requests": requests, "limits": limits},
            "volumeMounts": mounts,
        }  # fmt: skip
        pod_spec: dict[str, Any] = {
            "terminationGracePeriodSeconds": self.drain_delay
            + self.drain_timeout
            + SHUTDOWN_MARGIN_S,
            "containers": [container],
            "volumes": volumes,
        }
        if init:
            pod_spec["initContainers"] = init
        if getattr(k8s.node_selectors, role):
            pod_spec["nodeSelector"] = dict(getattr(k8s.node_selectors, role))
        labels = self.labels(role)
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(name, role),
            "spec": {
                "replicas": pool.count,
                "selector": {"matchLabels": labels},
                # A new pod is ready (and admitted by the proxy) before an old one drains.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "template": {
                    "metadata": {"labels": labels, "annotations": _scrape(port)},
                    "spec": pod_spec,
                },
            },
        }
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(name, role),
            "spec": {
                "clusterIP": "None",  # headless: one DNS record per ready pod
                "selector": labels,
                "ports": [
                    {"name": "http", "port": port, "targetPort": "http"},
                    {"name": "side-channel", "port": side, "targetPort": "side-channel"},
                ],
            },
        }
        pdb = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": self.meta(name, role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
        }
        return [service, deployment, pdb]

    # ------------------------------------------------------------------ proxy

    def proxy_settings(self) -> dict[str, Any]:
        """The proxy's YAML: the deployment's ``proxy`` section, both pools found by DNS, keys
        from the mounted Secret, listening on every address of its pod."""
        from splitserve.proxy.config import ProxyConfig, describe_validation_error

        dep = self.dep
        prefill_dns: dict[str, Any] = {
            "name": f"{self.prefix}-prefill",
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
                "decode": {"name": f"{self.prefix}-decode", "port": dep.decode.base_port},
                "ttl_s": self.k8s.dns_ttl_s,
            },
        }
        try:
            ProxyConfig.model_validate(data)
        except ValidationError as e:
            raise DeploymentError(
                "\n".join(f"proxy.{line}" for line in describe_validation_error(e).splitlines())
            ) from None
        return data

    def proxy(self) -> list[dict[str, Any]]:
        k8s = self.k8s
        name = f"{self.prefix}-proxy"
        port = proxy_port(self.dep)
        labels = self.labels("proxy")
        config = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.meta(name, "proxy"),
            "data": {"proxy.yaml": yaml.safe_dump(self.proxy_settings(), sort_keys=False)},
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
            "lifecycle": {"preStop": {"sleep": {"seconds": self.drain_delay}}},
            "resources": {"requests": {"cpu": res.cpu, "memory": res.memory},
                          "limits": {"memory": res.memory}},
            "volumeMounts": [
                {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
                {"name": "config", "mountPath": PROXY_CONFIG_DIR, "readOnly": True},
            ],
        }  # fmt: skip
        pod_spec: dict[str, Any] = {
            "terminationGracePeriodSeconds": self.drain_delay + SHUTDOWN_MARGIN_S,
            "containers": [container],
            "volumes": [self.keys_volume(), {"name": "config", "configMap": {"name": name}}],
        }
        if k8s.node_selectors.proxy:
            pod_spec["nodeSelector"] = dict(k8s.node_selectors.proxy)
        deployment = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self.meta(name, "proxy"),
            "spec": {
                "replicas": k8s.proxy_replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels, "annotations": _scrape(port)},
                    "spec": pod_spec,
                },
            },
        }
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(name, "proxy"),
            "spec": {
                "type": k8s.proxy_service_type,
                "selector": labels,
                "ports": [{"name": "http", "port": port, "targetPort": "http"}],
            },
        }
        return [config, deployment, service]

    def kustomization(self) -> dict[str, Any]:
        image, _, tag = self.k8s.image.partition(":") if "@" not in self.k8s.image else (
            self.k8s.image, "", ""
        )  # fmt: skip
        data: dict[str, Any] = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
        }
        if self.k8s.namespace:
            data["namespace"] = self.k8s.namespace
        data["resources"] = list(FILES)
        entry = {"name": image, "newName": image}
        if tag:
            entry["newTag"] = tag
        data["images"] = [entry]
        return data


def _scrape(port: int) -> dict[str, str]:
    """Prometheus' annotation-based discovery (the proxy's /metrics needs its key: see
    docs/deployment.md)."""
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def _shape_flags(shape: dict[str, int]) -> list[str]:
    """``splitserve model build`` flags for a preset's shape overrides (its options' own
    names, read from the command)."""
    from splitserve.model_cli import build

    by_dest = {p.name: p.opts[0] for p in build.params if p.opts and p.name}
    flags = []
    for key, value in shape.items():
        if key not in by_dest:
            raise DeploymentError(
                f"model.shape.{key}: `splitserve model build` has no option for it"
            )
        flags += [by_dest[key], str(value)]
    return flags


def _without_local_key_file(dep: Deployment) -> Deployment:
    """A side-channel key file named in the deployment is a path on the local machine; in the
    pods the Secret's key (``SPLITSERVE_AUTH_KEY_FILE``) takes its place."""
    settings = dep.connector.settings
    if "auth_key_file" not in settings:
        return dep
    connector = dep.connector.model_copy(
        update={"settings": {k: v for k, v in settings.items() if k != "auth_key_file"}}
    )
    return dep.model_copy(update={"connector": connector})


def gpus_per_server(pool: PoolSettings) -> int:
    """GPUs one server of the pool uses: tensor x pipeline parallel size from its engine
    arguments, else the count in its ``gpus`` entry, else 1."""
    sizes = {"--tensor-parallel-size": 1, "--pipeline-parallel-size": 1}
    short = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
    args = pool.args
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        flag = short.get(flag, flag)
        if flag in sizes:
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                sizes[flag] = int(raw)
            except ValueError:
                raise DeploymentError(f"{flag}: {raw!r} is not a whole number") from None
    n = sizes["--tensor-parallel-size"] * sizes["--pipeline-parallel-size"]
    if n == 1 and pool.gpus:
        n = len(pool.gpus[0].split(","))
    return n


def generate_keys(dep: Deployment) -> dict[str, str]:
    """Fresh keys for the Secret (a new emit makes new keys: docs/deployment.md)."""
    keys = {ENGINE_API_KEY: generate_key(), PROXY_API_KEY: generate_key()}
    if needs_side_channel_key(dep, ignore_key_file=True):
        keys = {SIDE_CHANNEL_KEY: generate_key(), **keys}
    return keys


def build_manifests(
    dep: Deployment, source: str = "<config>", keys: dict[str, str] | None = None
) -> Manifests:
    """Every manifest of ``dep`` (``keys``: the Secret's values; fresh ones by default)."""
    k8s = settings_of(dep, source)
    b = _Builder(dep, k8s, keys if keys is not None else generate_keys(dep))
    return Manifests(
        {
            "secret.yaml": [b.secret()],
            "prefill.yaml": b.pool("prefill"),
            "decode.yaml": b.pool("decode"),
            "proxy.yaml": b.proxy(),
            "kustomization.yaml": [b.kustomization()],
        }
    )
