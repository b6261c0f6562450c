"""``splitserve up``: start a whole deployment from one YAML file (see ``splitserve.config``).

Runs in the user's terminal process; children are supervised by ``DeploymentRunner``.
Exit codes: 0 after Ctrl-C / SIGTERM, 1 when a server fails to start or dies more often than
the restart policy allows (its log tail is shown), 2 for a bad config file (the message names the
file and the field).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from typing import NoReturn

import click

from splitserve.config import DeploymentError, load_deployment
from splitserve.launch.deployment import (
    DeploymentRunner,
    PortInUseError,
    ensure_model,
    plan_servers,
    proxy_port,
)
from splitserve.launch.hosts import local_host
from splitserve.launch.process import ProcessStartError
from splitserve.launch.secrets import DeploymentSecrets


def _load(config: str):
    try:
        return load_deployment(config)
    except DeploymentError as e:
        raise click.UsageError(str(e)) from None


def _run(runner: DeploymentRunner, body: Callable[[], int], interrupted_rc: int) -> NoReturn:
    """Run ``body`` with signals handled and everything stopped at the end; exit with its code
    (1 on a start-up failure, ``interrupted_rc`` on Ctrl-C / SIGTERM)."""
    runner.install_signal_handlers()
    rc = 1
    try:
        rc = body()
    except (ProcessStartError, PortInUseError, FileNotFoundError, DeploymentError) as e:
        click.echo(f"start-up failed: {e}", err=True)
    except KeyboardInterrupt:
        rc = interrupted_rc
    finally:
        runner.stop()
    sys.exit(rc)


@click.command("up")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--print-commands",
    is_flag=True,
    help="Print the engine commands and environment this deployment runs, then exit.",
)
@click.option(
    "--emit",
    nargs=2,
    type=(click.Choice(["kubernetes"]), click.Path(file_okay=False)),
    default=None,
    metavar="kubernetes DIR",
    help="Write this deployment's Kubernetes manifests (and a kustomization.yaml) to DIR "
    "instead of starting it (docs/deployment.md, 'Kubernetes').",
)
@click.option(
    "--host",
    "host",
    default=None,
    metavar="ADDR",
    help="A deployment placed on hosts (prefill.hosts, decode.hosts, proxy.host): start what is "
    "placed on ADDR. Default: the deployment's host that is an address of this machine.",
)
def up(config: str, print_commands: bool, emit: tuple[str, str] | None, host: str | None) -> None:
    """Start the prefill and decode servers and the proxy described by CONFIG."""
    dep = _load(config)
    if emit is not None:
        _emit_kubernetes(dep, config, emit[1])
        return
    if print_commands:
        _print_commands(dep, config)
        return
    try:
        here = local_host(dep, host)
    except DeploymentError as e:
        raise click.UsageError(str(e)) from None
    runner = DeploymentRunner(dep, echo=click.echo, host=here)

    def serve() -> int:
        runner.start()
        if runner.runs_proxy:
            click.echo(f"\nsplitserve is serving at {runner.url} (Ctrl-C to stop). Try:\n")
            click.echo(f"  {runner.example_request()}\n")
        else:
            names = ", ".join(s.name for s in runner.planned)
            click.echo(f"\n{here}: {names} serving; the proxy is {runner.url} (Ctrl-C to stop)\n")
        return runner.supervise()

    _run(runner, serve, interrupted_rc=0)


def _print_commands(dep, config: str) -> None:
    """The engine commands (with their environment) ``up`` runs; for a deployment placed on
    hosts, one section per host, naming the ``up`` that runs it and the proxy it holds."""
    run_dir = dep.resolved_run_dir()
    secrets = DeploymentSecrets.create(dep, run_dir)
    planned = plan_servers(dep, ensure_model(dep), secrets.engine_env())
    hosts: list[str | None] = list(dep.host_addresses()) or [None]
    if dep.placed:
        click.echo(
            f"# keys: {secrets.engine_api_key_file.parent} (made once; copy this folder to the "
            "same path on every host before its `up`)\n"
        )
    for host in hosts:
        if host is not None:
            click.echo(f"# ===== host {host}: `splitserve up {config} --host {host}` runs =====\n")
        for s in planned:
            if host is not None and s.host != host:
                continue
            printable = {**s.command.env, **secrets.printable_env()}
            env = " ".join(
                f"{k}={v if k in secrets.printable_env() else shlex.quote(v)}"
                for k, v in printable.items()
            )
            args = shlex.join(s.command.argv)
            click.echo(f"# {s.name}\n{env} {args}\n")
        if host is not None and dep.proxy_host == host:
            click.echo(
                f"# proxy on {host}:{proxy_port(dep)} (its config, {run_dir / 'proxy.yaml'}, "
                "is written by `up` once this host's servers are ready)\n"
                f"{shlex.join([sys.executable, '-m', 'splitserve.cli', 'proxy', '--config'])} "
                f"{shlex.quote(str(run_dir / 'proxy.yaml'))}\n"
            )


def _emit_kubernetes(dep, config: str, out: str) -> None:
    from pathlib import Path

    from splitserve.launch.kubernetes import build_manifests

    try:
        manifests = build_manifests(dep, config)
    except DeploymentError as e:
        raise click.UsageError(str(e)) from None
    for path in manifests.write(Path(out)):
        click.echo(f"wrote {path}")
    click.echo(
        f"\napply with: kubectl apply -k {out}\n"
        "secret.yaml holds freshly generated keys: keep it private; emitting again makes new "
        "ones (docs/deployment.md, 'Kubernetes')."
    )


@click.command("demo")
@click.option(
    "--config",
    "config_file",
    default="configs/demo-cpu.yaml",
    show_default=True,
    type=click.Path(dir_okay=False),
)
def demo(config_file: str) -> None:
    """Start the CPU demo deployment, send a few requests through the proxy, print answers,
    TTFT and KV handoff figures, and shut down."""
    from splitserve.launch.demo import run_demo

    runner = DeploymentRunner(_load(config_file), echo=click.echo)

    def show() -> int:
        run_demo(runner, click.echo)
        return 0

    _run(runner, show, interrupted_rc=130)
