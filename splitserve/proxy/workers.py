"""Several proxy processes behind one port (``workers > 1``), so the proxy uses more than one core.

Runs in the ``splitserve proxy`` process (the parent), which starts ``workers`` child processes
(spawned, each its own event loop) that all listen on the same port with ``SO_REUSEPORT``; the
kernel spreads connections over them. Each worker routes, health-checks and retries on its own
(a server ejected by one worker is re-checked by every worker within one health interval).

Metrics: each worker writes its values to Prometheus' multiprocess directory (a temporary
directory the parent owns) and any worker's ``/metrics`` answers the sum over all of them
(in-flight gauges sum over live workers; ``server_healthy`` is the minimum, so 0 when any worker
has the server out). Invariants: a worker that dies is replaced (its metric files are marked
dead first); stopping the parent stops every worker; the directory is removed at exit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from splitserve.proxy.config import ProxyConfig

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _worker_main(config_json: str, metrics_dir: str) -> None:
    """Entry of one worker process (spawned: a fresh interpreter)."""
    os.environ[MULTIPROC_ENV] = metrics_dir  # before prometheus_client is first imported
    import asyncio

    from splitserve.proxy.config import ProxyConfig
    from splitserve.proxy.server import serve_until_stopped

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ProxyConfig.model_validate_json(config_json)
    try:
        import uvloop

        run: Callable[..., object] = uvloop.run
    except ImportError:
        run = asyncio.run
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    run(serve_until_stopped(config, reuse_port=True, signals=(signal.SIGTERM,)))


def _config_json(config: ProxyConfig) -> str:
    data = config.model_dump(mode="json")
    for key in ("api_key", "upstream_api_key"):  # SecretStr dumps as '**********'
        secret = getattr(config, key)
        data[key] = None if secret is None else secret.get_secret_value()
    import json

    return json.dumps(data)


class WorkerPool:
    """Start, watch and stop the worker processes."""

    def __init__(self, config: ProxyConfig, workers: int) -> None:
        if config.port == 0:
            raise ValueError("port: several workers need a fixed port (0 picks one per worker)")
        self.config = config
        self.workers = workers
        self.metrics_dir = tempfile.mkdtemp(prefix="splitserve-proxy-metrics-")
        self._ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._config_json = _config_json(config)
        self._stopping = False

    def _spawn(self) -> BaseProcess:
        p = self._ctx.Process(
            target=_worker_main,
            args=(self._config_json, self.metrics_dir),
            name="splitserve-proxy-worker",
            daemon=True,
        )
        p.start()
        return p

    def start(self) -> None:
        self._procs = [self._spawn() for _ in range(self.workers)]

    def watch(self, poll_s: float = 1.0) -> None:
        """Block, replacing dead workers, until ``stop`` (or a signal) ends it."""
        from prometheus_client import multiprocess

        while not self._stopping:
            for i, p in enumerate(self._procs):
                if not p.is_alive() and not self._stopping:
                    logger.warning(
                        "proxy worker %s exited (code %s); restarting", p.pid, p.exitcode
                    )
                    if p.pid is not None:
                        multiprocess.mark_process_dead(p.pid, self.metrics_dir)
                    self._procs[i] = self._spawn()
            time.sleep(poll_s)

    def signal_workers(self, signum: int) -> None:
        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signum)

    def stop(self) -> None:
        self._stopping = True
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def run_workers(config: ProxyConfig, workers: int) -> None:
    """Run ``workers`` proxy processes on ``config.port`` until SIGINT / SIGTERM."""
    pool = WorkerPool(config, workers)

    def on_signal(signum: int, frame: object) -> None:
        pool._stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if config.discovery is not None and config.discovery.pool_file is not None:
        # SIGHUP (reload the pool file: splitserve.proxy.discovery) goes to every worker.
        signal.signal(signal.SIGHUP, lambda signum, frame: pool.signal_workers(signal.SIGHUP))
    pool.start()
    try:
        pool.watch()
    finally:
        pool.stop()
