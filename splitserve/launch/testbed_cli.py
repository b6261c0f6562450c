"""``splitserve testbed up|down|status``: the multi-host test bed by hand (see testbed.py).

The beds made here belong to the owner ``cli`` (not a pid), so they outlive the command and are
removed only by ``splitserve testbed down``; so do their delayers (``--delay-ms`` without
netem: one process per host in the switch namespace, stopped by ``down``). Run a command on a
host with ``ip netns exec ss-tb-cli-<host> <command>``.
"""

from __future__ import annotations

import click

from splitserve.launch import testbed as tb


def _bed(hosts: tuple[str, ...]) -> tb.Testbed:
    if not hosts:
        names = [
            ns[len(f"{tb.PREFIX}cli-") :]
            for ns in tb.namespaces()
            if ns.startswith(f"{tb.PREFIX}cli-") and ns != f"{tb.PREFIX}cli-sw"
        ]
        # Host n has address .n+1: rebuild the bed's order from the addresses it has.
        hosts = tuple(sorted(names, key=_address_of)) or ("p", "d", "proxy")
    return tb.Testbed(list(hosts), owner="cli")


def _address_of(host: str) -> int:
    out = tb._run(["ip", "-n", f"{tb.PREFIX}cli-{host}", "-4", "-br", "addr", "show", "eth0"])
    fields = out.stdout.split()
    return int(fields[2].split("/")[0].rsplit(".", 1)[1]) if len(fields) > 2 else 0


@click.group()
def testbed() -> None:
    """Emulated hosts (network namespaces on a bridge) for cross-host tests."""


@testbed.command()
@click.argument("hosts", nargs=-1)
@click.option("--rate-mbit", type=float, default=None, help="Shape every host's link to this.")
@click.option(
    "--loss-pct",
    type=float,
    default=0.0,
    help="Drop this % of frames both ways on every host's link (netem, else nftables).",
)
@click.option(
    "--delay-ms",
    type=float,
    default=0.0,
    help="Delay every host's link this much each way (netem, else an NFQUEUE delayer).",
)
@click.option(
    "--jitter-ms", type=float, default=0.0, help="Its standard deviation (normal, like netem)."
)
def up(
    hosts: tuple[str, ...],
    rate_mbit: float | None,
    loss_pct: float,
    delay_ms: float,
    jitter_ms: float,
) -> None:
    """Create the hosts (default: p d proxy), replacing a bed of ours left from before."""
    shape = tb.LinkShape(
        rate_mbit=rate_mbit, delay_ms=delay_ms, jitter_ms=jitter_ms, loss_pct=loss_pct
    )
    try:
        bed = _bed(hosts or ("p", "d", "proxy")).up()
        if rate_mbit or loss_pct or shape.needs_netem():
            for name in bed.hosts:
                bed.shape(name, shape)
    except tb.TestbedError as exc:
        raise click.ClickException(str(exc)) from exc
    for line in bed.status():
        click.echo(line)


@testbed.command()
def down() -> None:
    """Remove the bed made by ``up``."""
    _bed(()).down()


@testbed.command()
def status() -> None:
    """One line per host of the bed made by ``up``."""
    for line in _bed(()).status():
        click.echo(line)


@testbed.command()
@click.argument("host")
def cut(host: str) -> None:
    """Cut HOST's link silently (frames dropped both ways, no FIN or RST)."""
    _bed(()).cut(host)


@testbed.command()
@click.argument("host")
def heal(host: str) -> None:
    """Undo ``cut``."""
    _bed(()).heal(host)
