"""What a failing integration test says about the servers it talked to.

CI shows a failed test's one-line summary, not the servers' logs, so an HTTP error from a
server carries the last warnings of that server's log (``post`` in the connector tests adds
them to the answer it returns). The session's server groups register here (tests/conftest.py);
a test finds a server's log by the URL it posted to. Imported as ``from server_logs import ...``
(pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import re

from splitserve.launch.group import ServerGroup

GROUPS: list[ServerGroup] = []

# A vLLM/SGLang log line at WARNING or above (``WARNING 12-02 17:29:46 [file.py:204] ...``),
# or a Python traceback's last line.
_NOTABLE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|^\w*(Error|Exception): ")


def warnings_of(url: str, last: int = 3, width: int = 240) -> str:
    """The last ``last`` notable lines of the log of the server at ``url`` (joined by `` | ``,
    each cut to ``width`` characters); "" when no server of the session has that URL."""
    url = url.rstrip("/")
    for group in GROUPS:
        for server in list(group.servers.values()):
            if server.url.rstrip("/") != url:
                continue
            # the end of this run's log (ManagedProcess.tail: bounded, a restart's earlier runs
            # left out); its notable lines explain a failure
            text = server.process.tail(lines=2000)
            lines = [line.strip() for line in text.splitlines() if _NOTABLE.search(line)]
            return " | ".join(line[:width] for line in lines[-last:])
    return ""
