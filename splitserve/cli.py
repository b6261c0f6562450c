"""The ``splitserve`` command.

Subcommands live beside the code they drive (``splitserve/<part>/cli.py``) and are imported only
when invoked, so ``splitserve --help`` stays fast and never imports an engine.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

# name -> "module:attribute" of a click command; loaded on first use.
_SUBCOMMANDS: dict[str, str] = {
    "model": "splitserve.model_cli:model",
    "up": "splitserve.launch.cli:up",
    "demo": "splitserve.launch.cli:demo",
    "plan": "splitserve.planner.cli:plan",
    "simulate": "splitserve.planner.sim.cli:simulate",
    "proxy": "splitserve.proxy.cli:proxy",
    "testbed": "splitserve.launch.testbed_cli:testbed",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_LazyGroup)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """splitserve: disaggregated prefill/decode serving on stock vLLM and SGLang."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="splitserve")


if __name__ == "__main__":
    main()
