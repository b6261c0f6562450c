"""The Kubernetes objects of an engine pool: a headless Service, a Deployment, a
PodDisruptionBudget, and where the model comes from.

Runs in the ``splitserve`` CLI process, called by ``kubernetes.build_manifests`` once per pool
(prefill, decode). The engine's command line is ``splitserve.launch.deployment.server_command``,
the code ``splitserve up`` runs, with the pod's addresses instead of loopback; a preset model is
built by an init container (``splitserve model build``) into the models volume. What each
object is for and the drain timings: docs/deployment.md, "Kubernetes".

Invariants: every pod of a pool runs the same command on the same ports (each pod has its own
address); a pod reads the side-channel key from the mounted Secret
(``SPLITSERVE_AUTH_KEY_FILE``), never from a path of the machine that wrote the manifests, and
vLLM's API key from an env var that references the Secret; its ``preStop`` hook
(``kubernetes_drain.py``) and its grace period cover the drain.
"""

from __future__ import annotations

import math
from typing import Any

from splitserve.config import Deployment, DeploymentError, PoolSettings
from splitserve.launch.deployment import server_command
from splitserve.launch.kubernetes_common import (
    DEFAULT_SIDE_CHANNEL_PORT,
    ENGINE_API_KEY,
    KEYS_DIR,
    MODELS_DIR,
    SHUTDOWN_MARGIN_S,
    SIDE_CHANNEL_KEY,
    ObjectContext,
    scrape_annotations,
)
from splitserve.launch.kubernetes_settings import ENGINE_DEFAULTS
from splitserve.launch.secrets import ENGINE_API_KEY_ENV
from splitserve.models import PRESETS, ModelSpec
from splitserve.transfer.auth import KEY_FILE_ENV


def engine_pool(ctx: ObjectContext, role: str) -> list[dict[str, Any]]:
    """A pool's headless Service, its Deployment and its PodDisruptionBudget."""
    dep, k8s = ctx.dep, ctx.k8s
    pool: PoolSettings = getattr(dep, role)
    name = f"{ctx.prefix}-{role}"
    port = pool.base_port
    side = pool.side_channel_base_port or DEFAULT_SIDE_CHANNEL_PORT
    model, init, model_volume = model_source(ctx)
    key_env = {}
    if SIDE_CHANNEL_KEY in ctx.keys:
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
            "valueFrom": {"secretKeyRef": {"name": ctx.secret_name, "key": ENGINE_API_KEY}},
        },
        *ctx.env_list(cmd.env),
    ]
    res = getattr(k8s.resources, role) or ENGINE_DEFAULTS[dep.device]
    requests: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, Any] = {"memory": res.memory}
    volumes = [ctx.keys_volume(), model_volume]
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
            "--delay-s", str(ctx.drain_delay), "--timeout-s", str(ctx.drain_timeout),
        ]}}},
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
    }  # fmt: skip
    pod_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": ctx.drain_delay + ctx.drain_timeout + SHUTDOWN_MARGIN_S,
        "containers": [container],
        "volumes": volumes,
    }
    if init:
        pod_spec["initContainers"] = init
    if getattr(k8s.node_selectors, role):
        pod_spec["nodeSelector"] = dict(getattr(k8s.node_selectors, role))
    labels = ctx.labels(role)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": ctx.meta(name, role),
        "spec": {
            "replicas": pool.count,
            "selector": {"matchLabels": labels},
            # A new pod is ready (and admitted by the proxy) before an old one drains.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {"labels": labels, "annotations": scrape_annotations(port)},
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": ctx.meta(name, role),
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
        "metadata": ctx.meta(name, role),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    }
    return [service, deployment, pdb]


def model_source(ctx: ObjectContext) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """The model path in the container, init containers that build it, and its volume."""
    dep, k8s = ctx.dep, ctx.k8s
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
