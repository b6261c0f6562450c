"""An engine pod's ``preStop`` hook: keep serving until the proxies stop sending work, then wait
for the work in flight to finish, so that Kubernetes' SIGTERM finds an idle engine.

Runs inside the engine's container, as ``python -m splitserve.launch.kubernetes_drain --port P
--delay-s D --timeout-s T`` (standard library only: it starts in well under a second). The
timings, and why they are what they are: docs/deployment.md, "Drain timings".

1. Sleep ``delay``: the pod has left its headless Service's DNS records, but each proxy holds its
   last answer until its next resolution; until then new requests may still arrive, and are
   served.
2. Poll the engine's ``/metrics`` until nothing runs, waits or holds KV blocks (a prefill server
   keeps a finished prompt's blocks until its decode server has read them), or ``timeout``.
Exit 0 either way: the hook's end lets Kubernetes send SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import time
import urllib.request

logger = logging.getLogger("splitserve.drain")

# vLLM's gauges that say the engine has work: requests running and waiting, KV blocks in use.
BUSY_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def busy(metrics_text: str) -> float:
    """The sum of the busy gauges over every label set (0.0 when the engine is idle)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUSY_METRICS:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return total


def wait_idle(url: str, timeout_s: float, poll_s: float = 1.0) -> bool:
    """Poll ``url`` (``/metrics``) until the engine is idle (True) or ``timeout_s`` (False). An
    engine that does not answer counts as idle: there is nothing left to protect."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                load = busy(resp.read().decode())
        except OSError as e:
            logger.warning("drain: %s did not answer (%s); stopping", url, e)
            return True
        if load == 0:
            return True
        if time.monotonic() >= end:
            logger.warning("drain: still busy (%g) after %g s; stopping anyway", load, timeout_s)
            return False
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="The engine's HTTP port.")
    parser.add_argument("--delay-s", type=float, required=True, help="Serve this long first.")
    parser.add_argument("--timeout-s", type=float, required=True, help="Longest wait for idle.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logger.info("drain: serving %g s more while the proxies drop this server", args.delay_s)
    time.sleep(args.delay_s)
    idle = wait_idle(f"http://127.0.0.1:{args.port}/metrics", args.timeout_s)
    logger.info("drain: done (%s)", "idle" if idle else "timed out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
