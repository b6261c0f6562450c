"""``splitserve proxy``: run the prefill/decode proxy from flags or a YAML file.

Runs in the proxy process (the command's own). Bad settings stop start-up with one line per
problem naming the field, and exit code 2; no traceback.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import click

from splitserve.proxy.config import ConfigError, ProxyConfig, build_config, read_config_data

logger = logging.getLogger(__name__)


def _endpoints(urls: tuple[str, ...], ports: tuple[int, ...], key: str) -> list[dict[str, Any]]:
    if ports and len(ports) != len(urls):
        raise ConfigError(
            f"prefill.{key}: give one --{key.replace('_', '-')} per --prefill "
            f"({len(urls)} servers, {len(ports)} ports)"
        )
    out: list[dict[str, Any]] = [{"url": u} for u in urls]
    for entry, port in zip(out, ports, strict=False):
        entry[key] = port
    return out


def config_from_options(
    config_file: str | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    side_channel_port: tuple[int, ...],
    bootstrap_port: tuple[int, ...],
    overrides: dict[str, Any],
) -> ProxyConfig:
    """Merge a YAML file (if any) with the flags; flags win."""
    # The file's raw settings, validated once with the flags merged in (a key from the flags
    # or SPLITSERVE_PROXY_API_KEY may be what lets its host be non-loopback).
    data: dict[str, Any] = dict(read_config_data(config_file)) if config_file else {}
    if overrides.get("api_key") is not None:
        data.pop("api_key_file", None)  # the flag's key replaces the file's
    if prefill:
        entries = _endpoints(prefill, side_channel_port, "side_channel_port")
        if bootstrap_port:
            for e, b in zip(
                entries, _endpoints(prefill, bootstrap_port, "bootstrap_port"), strict=True
            ):
                e.update(b)
        data["prefill"] = entries
    elif side_channel_port or bootstrap_port:
        raise ConfigError("prefill: --side-channel-port / --bootstrap-port need --prefill URLs")
    if decode:
        data["decode"] = [{"url": u} for u in decode]
    data.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("prefill", "decode"):
        if key not in data and not data.get("discovery"):
            raise ConfigError(f"{key}: give at least one --{key} URL (or a --config file)")
    config = build_config(data)
    config.client_key()  # an unreadable api_key_file stops start-up here, naming the file
    return config


@click.command("proxy")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="YAML settings.")
@click.option("--prefill", multiple=True, metavar="URL", help="A prefill server (repeat).")
@click.option("--decode", multiple=True, metavar="URL", help="A decode server (repeat).")
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), default=None)
@click.option("--flow", type=click.Choice(["concurrent", "sequential"]), default=None)
@click.option(
    "--side-channel-port",
    multiple=True,
    type=int,
    help="vLLM concurrent flow: each prefill server's connector side-channel port, in order.",
)
@click.option(
    "--bootstrap-port",
    multiple=True,
    type=int,
    help="SGLang: each prefill server's bootstrap port.",
)
@click.option("--host", default=None, help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to listen on (default 8000).")
@click.option(
    "--api-key", default=None, envvar="SPLITSERVE_PROXY_API_KEY", help="Required client key."
)
@click.option(
    "--workers", type=int, default=None, help="Proxy processes sharing the port (default 1)."
)
@click.option(
    "--first-token-from-prefill/--no-first-token-from-prefill",
    default=None,
    help="vLLM concurrent flow: stream the first token P samples as soon as P answers and let "
    "D continue from it (default: on for the vLLM concurrent flow).",
)
def proxy(
    config_file: str | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    engine: str | None,
    flow: str | None,
    side_channel_port: tuple[int, ...],
    bootstrap_port: tuple[int, ...],
    host: str | None,
    port: int | None,
    api_key: str | None,
    workers: int | None,
    first_token_from_prefill: bool | None,
) -> None:
    """One OpenAI-compatible endpoint over pools of prefill and decode servers."""
    overrides = {
        "first_token_from_prefill": first_token_from_prefill,
        "engine": engine,
        "flow": flow,
        "host": host,
        "port": port,
        "api_key": api_key,
        "workers": workers,
    }
    try:
        config = config_from_options(
            config_file, prefill, decode, side_channel_port, bootstrap_port, overrides
        )
    except ConfigError as e:
        raise click.UsageError(f"invalid proxy settings:\n{e}") from None

    if config.workers > 1:
        _run_workers(config)
        return

    from splitserve.proxy.server import serve_until_stopped

    def started(bound_port: int) -> None:
        click.echo(
            f"splitserve proxy ({config.engine}, {config.flow} flow) on "
            f"http://{config.host}:{bound_port}: {len(config.prefill)} prefill, "
            f"{len(config.decode)} decode servers"
        )

    try:
        import uvloop  # optional: a faster event loop when installed

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve_until_stopped(config, started))
    except KeyboardInterrupt:  # a SIGINT before the loop ran
        logger.info("proxy stopped")
    except OSError as e:
        raise click.ClickException(f"cannot listen on {config.host}:{config.port}: {e}") from None


def _run_workers(config: ProxyConfig) -> None:
    import threading

    from splitserve.netutil import http_ok
    from splitserve.proxy.workers import run_workers

    def announce() -> None:
        url = f"http://{config.host}:{config.port}"
        for _ in range(600):
            if http_ok(url + "/health"):
                click.echo(
                    f"splitserve proxy ({config.engine}, {config.flow} flow) on {url}: "
                    f"{config.workers} workers, {len(config.prefill)} prefill, "
                    f"{len(config.decode)} decode servers"
                )
                return
            threading.Event().wait(0.1)

    threading.Thread(target=announce, daemon=True).start()
    run_workers(config, config.workers)
