"""A proxy on its own event loop in a daemon thread: the harness tests, benchmarks and notebooks
use to run ``server.ProxyServer`` beside blocking code.

Runs in the caller's process, on a thread of its own; nothing on the serving path imports it.
Invariants: ``start`` returns only once the proxy listens (or raises what stopped it);
``stop`` cancels the server's task and joins the thread, so the port is free afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from splitserve.proxy.config import ProxyConfig
from splitserve.proxy.server import ProxyServer, ProxyState


class BackgroundProxy:
    """A proxy on its own event loop in a daemon thread (tests, benchmarks, notebooks).

    ``with BackgroundProxy(config) as proxy: ... proxy.url``; port 0 picks a free port.
    """

    def __init__(self, config: ProxyConfig, start_timeout: float = 30.0) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self.port: int | None = None
        self.proxy: ProxyServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def state(self) -> ProxyState:
        assert self.proxy is not None
        return self.proxy.state

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            self.proxy = await ProxyServer(self.config).start()
            try:
                self.port = self.proxy.port
                self._ready.set()
                await asyncio.Event().wait()
            finally:
                await self.proxy.close()

        self._task = loop.create_task(main())
        try:
            loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # reported to the thread that started us
            self._error = e
            self._ready.set()
        finally:
            loop.close()

    def start(self) -> BackgroundProxy:
        self._thread = threading.Thread(target=self._run, name="splitserve-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout):
            raise RuntimeError(f"proxy did not start within {self.start_timeout} s")
        if self._error is not None:
            raise RuntimeError(f"proxy failed to start: {self._error!r}") from self._error
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the proxy's loop and return its result (for state inspection)."""
        assert self._loop is not None
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            box.append(fn())
            done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)
        return box[0]

    def stop(self) -> None:
        if self._loop is not None and self._task is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> BackgroundProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
