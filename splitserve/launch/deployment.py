"""Run a whole deployment from a validated ``Deployment``: model, servers, proxy, shutdown.

Runs in the ``splitserve up`` process, which supervises every child (engine servers and the
proxy) through a ``ServerGroup``: each child in its own process group with a log file in the run
directory; any start-up failure stops everything and shows the failing server's log tail. Once
serving, a child that dies is restarted under the deployment's restart policy
(``splitserve.launch.supervisor``) while the rest keep serving; a signal, or the policy giving
up, stops everything. No child outlives ``up``. A deployment placed on hosts
(``PoolSettings.hosts``) is run by one ``up`` per host, each starting its host's share
(``hosts.local_host``; docs/deployment.md, "Across hosts").

The engine command lines come from ``splitserve.launch.engines`` (no engine import here), so
``describe`` can print exactly what ``up`` runs, for users porting it to their orchestrator.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import SecretStr

from splitserve.config import (
    Deployment,
    DeploymentError,
    PoolSettings,
    placeholder_side_ports,
    proxy_config_for,
    url_host,
)
from splitserve.connectors.lmcache.settings import LMCacheRemote, composed_kv_config
from splitserve.launch import engines
from splitserve.launch.group import ServerGroup
from splitserve.launch.secrets import DeploymentSecrets
from splitserve.launch.supervisor import Supervisor
from splitserve.models import PRESETS, ModelSpec, build_model
from splitserve.netutil import free_port, is_loopback, port_in_use

if TYPE_CHECKING:
    from splitserve.proxy.config import ProxyConfig

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
SCHEDULER_CLS = "splitserve.schedulers.vllm.AdaptiveChunkScheduler"
LMCACHE_TIER = "lmcache-server"  # the group member that runs LMCache's cache server
# A single-host deployment's D contacts only prefill side channels on loopback (unless the
# connector settings name other hosts): a request naming any other remote_host gets a 400.
LOOPBACK_PREFILL_HOSTS = ["127.0.0.0/8", "::1", "localhost"]


@dataclass
class PlannedServer:
    """One engine server of the deployment, fully resolved."""

    name: str
    role: str  # "prefill" | "decode"
    port: int
    side_channel_port: int | None
    command: engines.ServerCommand
    host: str = HOST  # the address it binds: its placed host's (PoolSettings.hosts) or loopback


def model_dir(dep: Deployment) -> Path:
    """Where the model is: the configured path, or the preset built under the run directory."""
    if dep.model.path is not None:
        return Path(dep.model.path).expanduser().resolve()
    spec = _spec(dep)
    return (dep.resolved_run_dir() / "models" / f"{dep.model.preset}-seed{spec.seed}").resolve()


def _spec(dep: Deployment) -> ModelSpec:
    assert dep.model.preset is not None
    return ModelSpec(**{**PRESETS[dep.model.preset].model_dump(), **dep.model.shape})


def ensure_model(dep: Deployment) -> str:
    """The model argument for the engines: a local directory (a preset is built unless an
    identical one is there), or a hub id passed through on a GPU machine."""
    path = model_dir(dep)
    if dep.model.path is not None:
        if (path / "config.json").is_file():
            return str(path)
        if dep.device == "gpu" and _HUB_ID.match(dep.model.path):
            return dep.model.path
        raise FileNotFoundError(f"model.path: {path} has no config.json")
    spec = _spec(dep)
    meta = path / "splitserve-model.json"
    if meta.is_file() and json.loads(meta.read_text()).get("spec") == spec.model_dump():
        return str(path)
    return str(build_model(spec, path))


def _kv_transfer_config(
    dep: Deployment, side_port: int | None, side_host: str = HOST
) -> tuple[dict[str, Any], dict[str, str]]:
    """The --kv-transfer-config of one server, and the env it needs."""
    if dep.connector.name == "nixl":
        cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if dep.device == "cpu":
            cfg["kv_buffer_device"] = "cpu"
        if dep.connector.settings:
            cfg["kv_connector_extra_config"] = dict(dep.connector.settings)
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": side_host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        }
        return cfg, env
    extra = {
        **dep.connector.settings,
        "side_channel_host": side_host,
        "side_channel_port": side_port,
    }
    p_tp, d_tp = dep.prefill.tensor_parallel_size, dep.decode.tensor_parallel_size
    if p_tp != d_tp:  # each rank's peers (connectors/vllm/ranks.py); equal: the default
        extra.setdefault("prefill_tp_size", p_tp)
        extra.setdefault("decode_tp_size", d_tp)
    if is_loopback(side_host):  # every P of this deployment is on this host's loopback
        extra.setdefault("allowed_prefill_hosts", list(LOOPBACK_PREFILL_HOSTS))
    elif side_host in dep.host_addresses():  # placed on hosts: D contacts only the Ps' hosts
        prefill_hosts = list(dict.fromkeys(dep.prefill.hosts or []))
        extra.setdefault("allowed_prefill_hosts", prefill_hosts)
    cfg = {
        "kv_connector": "SplitserveConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if dep.device == "cpu":
        cfg["kv_buffer_device"] = "cpu"
    return cfg, {}


def _scheduler_args(pool: PoolSettings) -> list[str]:
    """``--scheduler-cls`` and its settings (vLLM's ``--additional-config``), if enabled."""
    if pool.scheduler is None:
        return []
    from splitserve.schedulers.policy import ADDITIONAL_CONFIG_KEY

    return [
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--additional-config",
        json.dumps({ADDITIONAL_CONFIG_KEY: pool.scheduler}),
    ]


def server_command(
    dep: Deployment,
    role: str,
    model: str | Path,
    port: int,
    side_port: int | None,
    *,
    host: str = HOST,
    side_host: str = HOST,
    cpu_core: int | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
) -> engines.ServerCommand:
    """One engine server of ``role``'s pool: the command both ``up`` (``plan_servers``) and
    the Kubernetes manifests (``splitserve.launch.kubernetes``) run. ``env`` comes last: the
    pool's own variables, then the keys'."""
    pool: PoolSettings = getattr(dep, role)
    kv_cfg, kv_env = _kv_transfer_config(dep, side_port, side_host)
    if role == "prefill" and dep.lmcache is not None:
        # LMCache first, then ours (docs/lmcache.md, "Composition"); its LMCACHE_* settings
        kv_cfg = composed_kv_config(kv_cfg)
        kv_env = {**kv_env, **dep.lmcache.env()}
    return engines.vllm_server(
        str(model),
        port,
        host=host,
        served_model_name=dep.model.served_name,
        kv_transfer_config=kv_cfg,
        extra_args=[*_scheduler_args(pool), *pool.args],
        cpu=dep.device == "cpu",
        cpu_core=cpu_core if dep.device == "cpu" else None,
        env={**kv_env, **(env or {})},
        python=python,
        # the request guard refuses bad kv_transfer_params with a 400 (docs/security.md)
        middleware=[engines.SPLITSERVE_GUARD] if dep.connector.name != "nixl" else [],
    )


def plan_servers(
    dep: Deployment, model: str | Path, secret_env: dict[str, str] | None = None
) -> list[PlannedServer]:
    """Resolve every server's ports, flags and environment (``secret_env``: the keys'
    variables, ``DeploymentSecrets.engine_env``). A server placed on a host binds that host's
    address (HTTP and side channel, which P also advertises) and has it as ``VLLM_HOST_IP``
    (a host without a default route leaves vLLM nothing to guess it from)."""
    planned: list[PlannedServer] = []
    for role in ("prefill", "decode"):
        pool: PoolSettings = getattr(dep, role)
        for i in range(pool.count):
            address = pool.host(i)
            bind = address or HOST
            port = pool.base_port + i
            side = pool.side_channel_port(i)
            if side is None:
                side = free_port(bind)
            core = pool.cpu_cores[i] if pool.cpu_cores is not None else None
            gpu_env = {"CUDA_VISIBLE_DEVICES": pool.gpus[i]} if pool.gpus is not None else {}
            host_env = {"VLLM_HOST_IP": address} if address else {}
            cmd = server_command(
                dep,
                role,
                model,
                port,
                side,
                host=bind,
                side_host=bind,
                cpu_core=core,
                env={**gpu_env, **host_env, **pool.env, **(secret_env or {})},
            )
            planned.append(PlannedServer(f"{role}-{i}", role, port, side, cmd, bind))
    return planned


def lmcache_tier_here(dep: Deployment, planned: list[PlannedServer]) -> LMCacheRemote | None:
    """LMCache's shared tier when this ``up`` starts it: asked for, and a P server among
    ``planned`` (the servers this ``up`` runs)."""
    remote = dep.lmcache.remote if dep.lmcache is not None else None
    if remote is None or not remote.start or not any(s.role == "prefill" for s in planned):
        return None
    return remote


class PortInUseError(RuntimeError):
    """A port the deployment needs is taken; raised before anything is started."""


def check_ports(
    dep: Deployment, planned: list[PlannedServer], with_proxy: bool = True, host: str = HOST
) -> None:
    """Fail fast, before starting anything, if a port this ``up`` needs on ``host`` (its
    servers' and, ``with_proxy``, the proxy's) is taken."""
    wanted = [("proxy.port", proxy_port(dep))] if with_proxy else []
    if (tier := lmcache_tier_here(dep, planned)) is not None:
        wanted.append(("lmcache.remote.port", tier.port))
    for s in planned:
        wanted.append((f"{s.name} (HTTP)", s.port))
        if s.side_channel_port is not None:
            wanted.append((f"{s.name} (KV side channel)", s.side_channel_port))
    taken = [f"{what}: port {port}" for what, port in wanted if port_in_use(port, host)]
    if taken:
        raise PortInUseError(
            "ports already in use on "
            + host
            + ": "
            + "; ".join(taken)
            + ". Stop what holds them or change the ports in the deployment file."
        )


def write_proxy_config(
    dep: Deployment,
    planned: list[PlannedServer],
    path: Path,
    secrets: DeploymentSecrets | None = None,
    model: str | Path | None = None,
) -> Path:
    """The proxy's YAML, with the engines' API key when ``secrets`` holds one (keys written in
    clear in a file only its owner may read: mode 0600, created so), and, for the per-request
    decision (``proxy.decide``), the served ``model`` as its tokenizer unless one is named."""
    side_ports = [s.side_channel_port for s in planned if s.role == "prefill"]
    cfg = proxy_config_for(dep, side_ports, host=HOST)
    if cfg.decide is not None and cfg.decide.tokenizer is None and model is not None:
        decide = cfg.decide.model_copy(update={"tokenizer": str(model)})
        cfg = cfg.model_copy(update={"decide": decide})
    if secrets is not None:
        cfg = cfg.model_copy(update={"upstream_api_key": SecretStr(secrets.engine_api_key)})
    data = _reveal(cfg.model_dump(mode="python", exclude_none=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(data, sort_keys=False))
    return path


def _reveal(obj: Any) -> Any:
    if isinstance(obj, SecretStr):
        return obj.get_secret_value()
    if isinstance(obj, dict):
        return {k: _reveal(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_reveal(v) for v in obj]
    return obj


def proxy_port(dep: Deployment) -> int:
    return int(dep.proxy.get("port", 8000))


class DeploymentRunner:
    """Start, supervise and stop one deployment."""

    def __init__(
        self, dep: Deployment, echo: Callable[[str], None] = print, host: str | None = None
    ) -> None:
        """``host``: the host whose servers (and proxy) this runner starts, for a deployment
        placed on hosts (``hosts.local_host``); None: all of it, on loopback."""
        self.dep = dep
        self.echo = echo
        self.run_dir = dep.resolved_run_dir()
        self.group = ServerGroup(self.run_dir / "logs")
        self.planned: list[PlannedServer] = []
        self.secrets: DeploymentSecrets | None = None
        self.host = host or HOST
        self.runs_proxy = host is None or dep.proxy_host == host

    @property
    def url(self) -> str:
        return f"http://{url_host(self.dep.proxy_host or HOST)}:{proxy_port(self.dep)}"

    def start(self) -> None:
        """Build the model, start servers and proxy, wait for all with progress output."""
        self.echo(f"run directory: {self.run_dir} (logs in {self.run_dir / 'logs'})")
        # The proxy's client key is read now (an unreadable api_key_file fails here, not after
        # the engines took minutes to load); with one, the proxy's /ready needs it too, so its
        # readiness is probed on /health.
        client_key = self._proxy_client_key()
        model = ensure_model(self.dep)
        self.echo(f"model: {model}")
        self.secrets = DeploymentSecrets.create(self.dep, self.run_dir)
        planned = plan_servers(self.dep, model, self.secrets.engine_env())
        self.planned = [s for s in planned if s.host == self.host]
        check_ports(self.dep, self.planned, with_proxy=self.runs_proxy, host=self.host)
        self._start_lmcache_tier()
        for s in self.planned:
            self.group.add(s.name, s.command.argv, port=s.port, host=s.host, env=s.command.env)
            self.echo(
                f"started {s.name} on :{s.port}"
                + (f" (side channel :{s.side_channel_port})" if s.side_channel_port else "")
            )
        t0 = time.monotonic()
        last = [0.0]

        def progress(name: str, waited: float) -> None:
            now = time.monotonic() - t0
            if now - last[0] >= 10:
                last[0] = now
                states = ", ".join(
                    f"{s.name}: {'ready' if s.ready else 'starting'}"
                    for s in self.group.servers.values()
                )
                self.echo(f"[{now:4.0f} s] {states}")

        if self.planned:
            self.group.wait(self.dep.startup_timeout_s, on_wait=progress)
            self.echo(f"engine servers ready after {time.monotonic() - t0:.0f} s")
        if not self.runs_proxy:
            return
        proxy_yaml = write_proxy_config(
            self.dep, planned, self.run_dir / "proxy.yaml", self.secrets, model
        )
        self.group.add(
            "proxy",
            [sys.executable, "-m", "splitserve.cli", "proxy", "--config", str(proxy_yaml)],
            port=proxy_port(self.dep),
            host=self.host,
            ready_path="/health" if client_key else "/ready",
        )
        # Placed on hosts, the other hosts' servers may still be loading: /ready waits for them.
        self.group.wait(
            self.dep.startup_timeout_s + 60 if self.dep.placed else 60.0, names=["proxy"]
        )
        self.echo(f"proxy ready: {self.url}")

    def _start_lmcache_tier(self) -> None:
        """LMCache's cache server, the prefill pool's shared tier, when the deployment asks
        ``up`` to start it (a TCP server: ready once its port accepts; supervised and stopped
        with the engines). Started before the P servers, which connect to it."""
        remote = lmcache_tier_here(self.dep, self.planned)
        if remote is None:
            return
        self.group.add(
            LMCACHE_TIER, remote.argv(), port=remote.port, host=remote.host, ready_path=None
        )
        self.echo(f"started {LMCACHE_TIER} on {remote.url}")

    def _proxy_settings(self) -> ProxyConfig:
        """The proxy's settings before its ports are known (for its client key)."""
        return proxy_config_for(self.dep, placeholder_side_ports(self.dep), host=HOST)

    def _proxy_client_key(self) -> bytes | None:
        from splitserve.proxy.config import ConfigError

        try:
            return self._proxy_settings().client_key()
        except ConfigError as exc:
            raise DeploymentError(f"proxy: {exc}") from None

    def example_request(self) -> str:
        body = {
            "model": self.dep.model.served_name,
            "prompt": "hello world the quick brown fox",
            "max_tokens": 16,
            "temperature": 0,
        }
        auth = ""
        config = self._proxy_settings()
        if config.api_key is not None or config.api_key_file is not None:
            source = config.api_key_file or "<your proxy api_key>"
            auth = f'-H "Authorization: Bearer $(cat {source})" '
        return (
            f"curl -s {self.url}/v1/completions -H 'Content-Type: application/json' {auth}"
            f"-d '{json.dumps(body)}'"
        )

    def supervise(self) -> int:
        """Keep the deployment serving until a signal (exit 0), restarting a child that dies
        under the deployment's restart policy; exit 1 when the policy gives up
        (``splitserve.launch.supervisor``)."""
        return Supervisor(
            self.group,
            self.dep.restart,
            self.child_ports(),
            self.echo,
            host=self.host,
            startup_timeout_s=self.dep.startup_timeout_s,
        ).run()

    def child_ports(self) -> dict[str, list[int]]:
        """The ports each child listens on, which a restart waits to be free."""
        ports = {
            s.name: [s.port] + ([s.side_channel_port] if s.side_channel_port else [])
            for s in self.planned
        }
        if self.runs_proxy:
            ports["proxy"] = [proxy_port(self.dep)]
        if (tier := lmcache_tier_here(self.dep, self.planned)) is not None:
            ports[LMCACHE_TIER] = [tier.port]
        return ports

    @staticmethod
    def install_signal_handlers() -> None:
        """SIGTERM behaves like Ctrl-C: it interrupts start-up or supervision, and the caller's
        ``finally`` stops everything."""

        def _interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _interrupt)

    def stop(self) -> None:
        """Stop every child. Further Ctrl-C / SIGTERM are ignored until done, so a second
        interrupt cannot leave orphans behind."""
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.echo("stopping the deployment")
            self.group.stop()
            self.echo("all processes stopped")
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
