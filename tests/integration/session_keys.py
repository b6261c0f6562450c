"""The test session's deployment key, as every connector and backend reads it: a 0600 file
named by the environment (never a command line)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TEST_KEY = "splitserve-test-key"


def test_key_file(key: str = TEST_KEY) -> str:
    from splitserve.transfer.auth import write_key_file

    path = Path(tempfile.gettempdir()) / f"splitserve-test-{os.getpid()}" / "auth.key"
    if not path.exists():
        write_key_file(path, key)
    return str(path)


def key_env() -> dict[str, str]:
    """The environment that gives a server the test session's key."""
    return {"SPLITSERVE_AUTH_KEY_FILE": test_key_file()}
