"""Deployment settings: one YAML file describes a whole disaggregated deployment.

Validated at the edge (``load_deployment``) into pydantic models; every error names the file and
the field. The launcher (``splitserve.launch.deployment``) turns a validated ``Deployment`` into
engine command lines and a proxy config. Runs in the ``splitserve`` CLI process only; importing it
imports no engine.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from splitserve.connectors.lmcache.settings import LMCacheSettings
from splitserve.models import PRESETS, ModelSpec
from splitserve.netutil import is_loopback
from splitserve.proxy.config import ProxyConfig, describe_validation_error
from splitserve.transfer.tp import tp_mismatch

logger = logging.getLogger(__name__)


class DeploymentError(ValueError):
    """A deployment file that cannot be used; the message names the file and the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSettings(_Strict):
    """The served model: a local directory, or a test preset built on first use."""

    path: str | None = Field(
        None, description="A local model directory, or a Hugging Face id on a machine with a hub."
    )
    preset: str | None = Field(None, description=f"A test model preset: {sorted(PRESETS)}.")
    shape: dict[str, int] = Field(
        default_factory=dict, description="Overrides of the preset's shape (ModelSpec fields)."
    )
    served_name: str = Field("model", description="The name clients send as 'model'.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSettings:
        if (self.path is None) == (self.preset is None):
            raise ValueError("give exactly one of 'path' or 'preset'")
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(f"preset: unknown {self.preset!r}; choose from {sorted(PRESETS)}")
            ModelSpec(**{**PRESETS[self.preset].model_dump(), **self.shape})
        elif self.shape:
            raise ValueError("shape: only applies to a preset")
        return self


class ConnectorSettings(_Strict):
    """Which KV connector moves the cache, and its settings."""

    name: Literal["splitserve", "nixl"] = Field(
        "splitserve",
        description="'splitserve': SplitserveConnector (layer-wise); 'nixl': vLLM's stock "
        "NixlConnector (sequential flow only).",
    )
    settings: dict[str, Any] = Field(
        default_factory=dict,
        description="kv_connector_extra_config of the connector: SplitserveConnector's keys "
        "(the launcher sets side_channel_host/port per server), or for 'nixl' the stock "
        "connector's own (e.g. kv_lease_duration: seconds P keeps a finished prefill's blocks "
        "for D, 30 by default; a D that reads later gets whatever is there by then).",
    )

    @model_validator(mode="after")
    def _stock_lease(self) -> ConnectorSettings:
        lease = self.settings.get("kv_lease_duration")
        whole = isinstance(lease, int) and not isinstance(lease, bool)
        if self.name == "nixl" and lease is not None and not (whole and lease >= 6):
            raise ValueError(
                f"settings.kv_lease_duration: whole seconds >= 6 for the stock "
                f"NixlConnector (it heartbeats every lease/6 s), got {lease!r}"
            )
        return self


class PoolSettings(_Strict):
    """One pool of identical servers (prefill or decode)."""

    count: int = Field(1, ge=1, le=64)
    base_port: int = Field(..., ge=1024, le=65000, description="HTTP port of the first server.")
    side_channel_base_port: int | None = Field(
        None, ge=1024, le=65000, description="KV side channel port of the first server."
    )
    cpu_cores: list[int] | None = Field(
        None, description="CPU machines: core (OpenMP bind) of each server, in order."
    )
    gpus: list[str] | None = Field(
        None,
        description="GPU machines: CUDA_VISIBLE_DEVICES of each server, in order (e.g. '0,1' for "
        "tensor parallel 2).",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment.")
    args: list[str] = Field(default_factory=list, description="Extra engine arguments.")
    hosts: list[str] | None = Field(
        None,
        description="Across machines: the IP address of the host of each server, in order (bound "
        "by its HTTP server and side channel, VLLM_HOST_IP). `splitserve up --host ADDR` starts "
        "the servers placed on ADDR. Null: every server on the local host's loopback.",
    )
    scheduler: dict[str, Any] | None = Field(
        None,
        description="Adaptive chunk scheduler settings (BudgetPolicySettings); off if null. It "
        "belongs on decode servers (they decode, and prefill the prompts the proxy sends "
        "straight to them); on a prefill server it always answers its maximum chunk.",
    )

    @model_validator(mode="after")
    def _cores(self) -> PoolSettings:
        for key in ("cpu_cores", "gpus"):
            given = getattr(self, key)
            if given is not None and len(given) != self.count:
                raise ValueError(
                    f"{key}: {len(given)} given for {self.count} server(s); give one each"
                )
        if self.tensor_parallel_size < 1:
            raise ValueError("args: --tensor-parallel-size must be a whole number >= 1")
        if self.hosts is not None:
            if len(self.hosts) != self.count:
                raise ValueError(
                    f"hosts: {len(self.hosts)} given for {self.count} server(s); give one each"
                )
            for i, address in enumerate(self.hosts):
                problem = placement_problem(address)
                if problem:
                    raise ValueError(f"hosts[{i}]: {problem}")
        return self

    def host(self, index: int) -> str | None:
        """The address server ``index`` is placed on (None: the local host's loopback)."""
        return None if self.hosts is None else self.hosts[index]

    @property
    def tensor_parallel_size(self) -> int:
        """``--tensor-parallel-size`` (``-tp``) in ``args``, else 1 (0: not a whole number)."""
        args = self.args
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag in ("--tensor-parallel-size", "-tp"):
                raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
                return int(raw) if raw.isdigit() else 0
        return 1

    def side_channel_port(self, index: int) -> int | None:
        """Server ``index``'s side channel (base) port: SplitserveConnector binds one port per
        tensor parallel rank (base + rank), so servers are spaced by the TP size."""
        base = self.side_channel_base_port
        return None if base is None else base + index * self.tensor_parallel_size


def placement_problem(address: str) -> str | None:
    """Why ``address`` cannot place a server or the proxy on a host, or None. An IP address:
    it is bound (HTTP server, side channel) and is VLLM_HOST_IP, which a host name cannot be;
    neither a wildcard (advertised to peers as such) nor loopback (no other host reaches it)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address (give the address the other hosts reach)"
    if ip.is_unspecified or ip.is_loopback or ip.is_multicast:
        return (
            f"{address} cannot place a server: give the address of its host that the other "
            "hosts reach (not a wildcard, loopback or multicast address)"
        )
    return None


def url_host(address: str) -> str:
    """``address`` as the host part of a URL (an IPv6 address in brackets)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


class RestartSettings(_Strict):
    """What ``splitserve up`` does when one of its children (an engine server or the proxy)
    exits: restart it with backoff, within a limit per window, or stop the deployment
    (``splitserve.launch.restart``, docs/deployment.md)."""

    policy: Literal["always", "on-failure", "never"] = Field(
        "on-failure",
        description="'always': restart any exit; 'on-failure': a non-zero exit or a signal; "
        "'never': any exit stops the whole deployment.",
    )
    max_restarts: int = Field(
        5, ge=0, le=1000, description="Restarts of one child allowed within window_s seconds."
    )
    window_s: float = Field(300.0, gt=0, description="The window max_restarts counts over.")
    backoff_s: float = Field(
        1.0, ge=0, le=3600, description="Wait before a first restart; doubled per restart."
    )
    max_backoff_s: float = Field(30.0, ge=0, le=3600, description="The most a restart waits.")
    port_wait_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="How long a restart waits for the dead child's ports to be free before the "
        "deployment gives up.",
    )

    @model_validator(mode="after")
    def _cap(self) -> RestartSettings:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"max_backoff_s: {self.max_backoff_s:g} is below backoff_s {self.backoff_s:g}"
            )
        return self


class Deployment(_Strict):
    """A whole deployment: model, engine, prefill and decode pools, connector, proxy."""

    name: str = Field("splitserve", pattern=r"^[A-Za-z0-9_.-]+$")
    engine: Literal["vllm"] = Field(
        "vllm", description="The engine. 'up' starts vLLM deployments; SGLang: see examples/."
    )
    device: Literal["cpu", "gpu"] = "cpu"
    model: ModelSettings
    prefill: PoolSettings
    decode: PoolSettings
    connector: ConnectorSettings = ConnectorSettings()
    proxy: dict[str, Any] = Field(
        default_factory=dict,
        description="Proxy settings (ProxyConfig fields other than engine/prefill/decode).",
    )
    run_dir: str = Field("runs/{name}", description="Logs and built models go here.")
    startup_timeout_s: float = Field(600.0, gt=0)
    restart: RestartSettings = Field(
        default_factory=RestartSettings,
        description="Restart policy of the servers and the proxy once the deployment serves.",
    )
    kubernetes: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of the Kubernetes manifests (`splitserve up CONFIG --emit "
        "kubernetes DIR`): KubernetesSettings in splitserve.launch.kubernetes_settings.",
    )
    lmcache: LMCacheSettings | None = Field(
        None,
        description="Prefix reuse across the prefill pool (docs/lmcache.md): each P server "
        "runs LMCache beside the splitserve connector; with `remote`, the pool shares LMCache's "
        "cache server, which `up` starts unless `remote.start` is false.",
    )

    @model_validator(mode="after")
    def _check(self) -> Deployment:
        self._check_placement()
        # (host, port): servers on different hosts may use the same ports
        ports: list[tuple[str | None, int]] = []
        for pool_name in ("prefill", "decode"):
            pool: PoolSettings = getattr(self, pool_name)
            tp = pool.tensor_parallel_size
            for i in range(pool.count):
                host = pool.host(i)
                ports.append((host, pool.base_port + i))
                side = pool.side_channel_port(i)
                if side is not None:
                    ports += [(host, side + rank) for rank in range(tp)]
        proxy_port = self.proxy.get("port", 8000)
        ports.append((self.proxy_host, proxy_port))
        remote = self.lmcache.remote if self.lmcache is not None else None
        if remote is not None and remote.start:
            ports.append((None, remote.port))
        dup = sorted({p for h, p in ports if ports.count((h, p)) > 1})
        if dup:
            raise ValueError(
                f"ports overlap: {dup} (check base_port, side_channel_base_port, proxy.port)"
            )
        if self.connector.name == "splitserve" and self.prefill.side_channel_base_port is None:
            raise ValueError("prefill.side_channel_base_port: required by the splitserve connector")
        if self.connector.name == "splitserve":
            heads = None  # a preset knows its KV heads; a model directory is checked by vLLM
            if self.model.preset is not None:
                spec = {**PRESETS[self.model.preset].model_dump(), **self.model.shape}
                heads = ModelSpec(**spec).num_kv_heads
            mismatch = tp_mismatch(
                self.prefill.tensor_parallel_size, self.decode.tensor_parallel_size, heads
            )
            if mismatch:
                raise ValueError(f"prefill.args / decode.args: {mismatch}")
        for key in ("engine", "prefill", "decode"):
            if key in self.proxy:
                raise ValueError(f"proxy.{key}: set by the deployment, remove it here")
        if self.connector.name == "nixl" and self.proxy.get("flow") == "concurrent":
            raise ValueError("proxy.flow: the stock NixlConnector only has the sequential flow")
        self._check_lmcache()
        return self

    def _check_lmcache(self) -> None:
        """LMCache composes with our connector on P (docs/lmcache.md); placed on hosts, its
        shared tier must be one the operator runs, at an address every P host reaches."""
        if self.lmcache is None:
            return
        if self.connector.name != "splitserve":
            raise ValueError(
                "lmcache: composes with the splitserve connector (P runs MultiConnector of "
                f"LMCache and SplitserveConnector); connector.name is {self.connector.name!r}"
            )
        remote = self.lmcache.remote
        if self.placed and remote is not None and remote.start:
            raise ValueError(
                "lmcache.remote.start: placed on hosts, the prefill pool shares a tier that runs "
                "on its own: start LMCache's server there, set remote.start false and "
                "remote.host to its address"
            )
        local_only = remote is not None and (
            is_loopback(remote.host) or remote.host in ("", "0.0.0.0", "::")
        )
        if self.placed and local_only:
            raise ValueError(
                f"lmcache.remote.host: every prefill host must reach the shared tier; "
                f"{remote.host!r} is not an address they can (give the tier host's address or "
                "name)"
            )

    def _check_placement(self) -> None:
        """Placed on hosts: every server and the proxy, or none (docs/deployment.md)."""
        placed = {name: getattr(self, name).hosts is not None for name in ("prefill", "decode")}
        if not any(placed.values()):
            return
        for name, given in placed.items():
            if not given:
                raise ValueError(
                    f"{name}.hosts: required once another pool places its servers on hosts "
                    "(one address per server)"
                )
        for name in ("prefill", "decode"):
            if getattr(self, name).side_channel_base_port is None:
                raise ValueError(
                    f"{name}.side_channel_base_port: required when the servers are placed on "
                    "hosts (the `up` of every host must agree on every port)"
                )
        host = self.proxy.get("host")
        problem = placement_problem(host) if isinstance(host, str) else "not given"
        if problem:
            raise ValueError(
                f"proxy.host: the address of the proxy's host is required when the servers are "
                f"placed on hosts: {problem}"
            )

    @property
    def placed(self) -> bool:
        """Whether the servers and the proxy are placed on hosts (``PoolSettings.hosts``)."""
        return self.prefill.hosts is not None

    @property
    def proxy_host(self) -> str | None:
        """The proxy's host when placed, else None (the local host)."""
        return self.proxy.get("host") if self.placed else None

    def host_addresses(self) -> list[str]:
        """Every host of a placed deployment, in order of first appearance (prefill, decode,
        proxy); empty when not placed."""
        found: list[str] = []
        for pool in (self.prefill, self.decode):
            found += pool.hosts or []
        if self.proxy_host is not None:
            found.append(self.proxy_host)
        return list(dict.fromkeys(found))

    @property
    def flow(self) -> str:
        default = "concurrent" if self.connector.name == "splitserve" else "sequential"
        return self.proxy.get("flow", default)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir.format(name=self.name))


def format_errors(source: str, e: ValidationError) -> str:
    return "\n".join(f"{source}: {line}" for line in describe_validation_error(e).splitlines())


def parse_deployment(data: Any, source: str = "<config>") -> Deployment:
    """Validate a mapping; raise ``DeploymentError`` naming ``source`` and each bad field."""
    if not isinstance(data, dict):
        raise DeploymentError(f"{source}: expected a mapping of settings at the top level")
    try:
        dep = Deployment.model_validate(data)
    except ValidationError as e:
        raise DeploymentError(format_errors(source, e)) from None
    _validate_components(dep, source)
    return dep


def load_deployment(path: str | Path) -> Deployment:
    """Read a deployment YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise DeploymentError(f"{p}: cannot read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise DeploymentError(f"{p}: not valid YAML: {e}") from None
    return parse_deployment(data, str(p))


def _validate_components(dep: Deployment, source: str) -> None:
    """Check the nested settings with the owning component's own model, so errors surface at
    start-up of ``up`` rather than in a server's log a minute later."""
    try:
        proxy_config_for(dep, prefill_side_ports=placeholder_side_ports(dep))
    except ValidationError as e:
        raise DeploymentError(
            "\n".join(
                f"{source}: proxy.{line}" for line in describe_validation_error(e).splitlines()
            )
        ) from None
    if dep.prefill.scheduler is not None:
        logger.warning(
            "%s: prefill.scheduler is set: a prefill server never decodes, so the adaptive "
            "budget always answers its maximum chunk there; put it under decode.scheduler "
            "(docs/scheduler.md, 'Where the budget belongs')",
            source,
        )
    for pool_name in ("prefill", "decode"):
        sched = getattr(dep, pool_name).scheduler
        if sched is not None:
            _validate_with(
                "splitserve.schedulers.policy",
                "BudgetPolicySettings",
                sched,
                f"{source}: {pool_name}.scheduler",
            )
    if dep.connector.name == "splitserve":
        _validate_with(
            "splitserve.connectors.vllm.config",
            "SplitserveConnectorConfig",
            {**dep.connector.settings, "side_channel_port": 1},
            f"{source}: connector.settings",
        )


def _validate_with(module: str, cls_name: str, data: dict[str, Any], where: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise DeploymentError(f"{where}: this installation has no {module}")
    cls = getattr(importlib.import_module(module), cls_name)
    try:
        cls.model_validate(data)
    except ValidationError as e:
        raise DeploymentError(
            "\n".join(f"{where}.{line}" for line in describe_validation_error(e).splitlines())
        ) from None


def placeholder_side_ports(dep: Deployment) -> list[int | None]:
    """The prefill servers' side-channel ports as configured (None where the launcher chooses
    one at start): enough to build the proxy settings before the servers are planned."""
    return [dep.prefill.side_channel_port(i) for i in range(dep.prefill.count)]


def proxy_config_for(
    dep: Deployment, prefill_side_ports: list[int | None], host: str = "127.0.0.1"
) -> ProxyConfig:
    """The proxy settings of a deployment: its ``proxy`` section plus the two pools, each
    server at its placed address (``PoolSettings.hosts``), else at ``host``."""
    prefill = []
    for i, side in enumerate(prefill_side_ports):
        address = url_host(dep.prefill.host(i) or host)
        entry: dict[str, Any] = {"url": f"http://{address}:{dep.prefill.base_port + i}"}
        if side is not None and dep.connector.name == "splitserve":
            entry["side_channel_port"] = side
        prefill.append(entry)
    decode = [
        {"url": f"http://{url_host(dep.decode.host(i) or host)}:{dep.decode.base_port + i}"}
        for i in range(dep.decode.count)
    ]
    data = {
        "flow": dep.flow,
        **dep.proxy,
        "engine": dep.engine,
        "prefill": prefill,
        "decode": decode,
    }
    return ProxyConfig.model_validate(data)
