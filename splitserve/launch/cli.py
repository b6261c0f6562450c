"""``splitserve up``: start a whole deployment from one YAML file (see ``splitserve.config``).

Runs in the user's terminal process; children are supervised by ``DeploymentRunner``.
Exit codes: 0 after Ctrl-C / SIGTERM, 1 when a server fails (its log tail is shown), 2 for a
bad config file (the message names the file and the field).
"""

from __future__ import annotations

import shlex
import sys

import click

from splitserve.config import DeploymentError, load_deployment
from splitserve.launch.deployment import (
    DeploymentRunner,
    PortInUseError,
    ensure_model,
    plan_servers,
)
from splitserve.launch.process import ProcessStartError


@click.command("up")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option(
    "--print-commands",
    is_flag=True,
    help="Print the engine commands and environment this deployment runs, then exit.",
)
def up(config: str, print_commands: bool) -> None:
    """Start the prefill and decode servers and the proxy described by CONFIG."""
    try:
        dep = load_deployment(config)
    except DeploymentError as e:
        raise click.UsageError(str(e)) from None
    runner = DeploymentRunner(dep, echo=click.echo)
    if print_commands:
        for s in plan_servers(dep, ensure_model(dep)):
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s.command.env.items())
            args = shlex.join(s.command.argv)
            click.echo(f"# {s.name}\n{env} {args}\n")
        return
    runner.install_signal_handlers()
    rc = 1
    try:
        runner.start()
        click.echo(f"\nsplitserve is serving at {runner.url} (Ctrl-C to stop). Try:\n")
        click.echo(f"  {runner.example_request()}\n")
        rc = runner.supervise()
    except (ProcessStartError, PortInUseError, FileNotFoundError) as e:
        click.echo(f"start-up failed: {e}", err=True)
    except KeyboardInterrupt:
        rc = 0
    finally:
        runner.stop()
    sys.exit(rc)


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

    try:
        dep = load_deployment(config_file)
    except DeploymentError as e:
        raise click.UsageError(str(e)) from None
    runner = DeploymentRunner(dep, echo=click.echo)
    runner.install_signal_handlers()
    rc = 1
    try:
        run_demo(runner, click.echo)
        rc = 0
    except (ProcessStartError, PortInUseError, FileNotFoundError) as e:
        click.echo(f"start-up failed: {e}", err=True)
    except KeyboardInterrupt:
        rc = 130
    finally:
        runner.stop()
    sys.exit(rc)
