"""Who may talk on the side channel: CurveZMQ key pairs derived from the deployment's shared key,
the ZAP check that admits only peers holding it, and where the key comes from.

Runs in every process that opens a side channel (vLLM workers and engine core, SGLang schedulers,
tests). Imports no engine.

Why CurveZMQ and not a handshake of our own: ZMQ's CURVE mechanism already gives each connection
an authenticated, encrypted session with fresh ephemeral keys and per-message nonces, so a
replayed message is refused on any other connection and nothing is readable on the wire. Both
sides hold one shared secret (the deployment key), so both derive the same server and client key
pairs from it with HMAC-SHA256 under fixed labels; the server admits a client only if it proves
the client key (ZAP callback), and the client accepts the server only if it proves the server
key (the CURVE handshake does that). A peer without the key fails the handshake: its bytes never
reach our decoder. See docs/security.md.

Key sources, in order (``load_key``): a key file (the launcher writes one per deployment, mode
0600), the ``SPLITSERVE_AUTH_KEY_FILE`` environment variable naming one, the
``SPLITSERVE_AUTH_KEY`` environment variable holding the key. Never argv: a command line is
visible to every local user in ``ps`` and engines log their arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

KEY_FILE_ENV = "SPLITSERVE_AUTH_KEY_FILE"
KEY_ENV = "SPLITSERVE_AUTH_KEY"
MIN_KEY_CHARS = 16


class AuthKeyError(ValueError):
    """The auth key could not be read or is unusable; the message says what to do."""


def load_key(key_file: str | Path | None = None) -> bytes | None:
    """The deployment key from ``key_file``, else ``$SPLITSERVE_AUTH_KEY_FILE``, else
    ``$SPLITSERVE_AUTH_KEY``; ``None`` when none is set."""
    path = key_file or os.environ.get(KEY_FILE_ENV)
    if path:
        path = Path(path).expanduser()
        try:
            mode = path.stat().st_mode
            text = path.read_text().strip()
        except OSError as exc:
            raise AuthKeyError(f"cannot read the auth key file {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logging.getLogger(__name__).warning(
                "auth key file %s is readable by other users (mode %o); chmod 600 it",
                path,
                stat.S_IMODE(mode),
            )
        return _checked(text, f"auth key file {path}")
    text = os.environ.get(KEY_ENV, "").strip()
    return _checked(text, f"${KEY_ENV}") if text else None


def _checked(text: str, where: str) -> bytes:
    if len(text) < MIN_KEY_CHARS:
        raise AuthKeyError(
            f"{where} holds {len(text)} characters; use at least {MIN_KEY_CHARS} "
            "(`splitserve keygen` writes a fresh one)"
        )
    return text.encode()


def generate_key() -> str:
    """A fresh deployment key: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def write_key_file(path: Path, key: str | None = None) -> Path:
    """Write ``key`` (fresh when None) to ``path`` with mode 0600, created that way (the key is
    never readable by others, not even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((key or generate_key()) + "\n")
    os.chmod(path, 0o600)
    return path


@dataclass(frozen=True)
class CurveKeys:
    """The server and client CURVE key pairs every holder of the shared key derives alike."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, shared_key: bytes) -> CurveKeys:
        server_public, server_secret = _pair(shared_key, b"server")
        client_public, client_secret = _pair(shared_key, b"client")
        return cls(server_public, server_secret, client_public, client_secret)

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


def _pair(shared_key: bytes, role: bytes) -> tuple[bytes, bytes]:
    secret = hmac.new(shared_key, b"splitserve-side-channel-curve-" + role, hashlib.sha256)
    secret_z85 = zmq.utils.z85.encode(secret.digest())
    return zmq.curve_public(secret_z85), secret_z85


class _ClientKeyCheck:
    """ZAP credentials provider: admit exactly the client key derived from the shared key."""

    def __init__(self, keys: CurveKeys, peer_log: PeerLog) -> None:
        self._client_public = keys.client_public
        self._peer_log = peer_log

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = hmac.compare_digest(client_key, self._client_public)
        if not ok:
            self._peer_log.warn(
                "zap",
                "client-key",
                "side channel: refused a client whose CURVE key is not the deployment's "
                "(a peer with another auth key)",
            )
        return ok


def start_authenticator(ctx: zmq.Context, keys: CurveKeys, peer_log: PeerLog):
    """Start the ZAP handler for ``ctx``'s CURVE server sockets (stop it before the context)."""
    authenticator = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
    authenticator.start()
    authenticator.configure_curve_callback(
        "*", credentials_provider=_ClientKeyCheck(keys, peer_log)
    )
    return authenticator


class PeerLog:
    """Log a problem once per (peer, kind), again at most once a minute: a hostile or broken
    peer cannot flood the log, and an operator still sees every distinct cause. Thread-safe;
    remembers a bounded number of peers."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0, cap: int = 4096) -> None:
        self._logger = logger
        self._every_s = every_s
        self._cap = cap
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def warn(self, peer: str, kind: str, msg: str, *args) -> bool:
        """Log ``msg`` as a warning unless this (peer, kind) was logged within the minute;
        True when it was logged now."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get((peer, kind))
            if last is not None and now - last < self._every_s:
                return False
            if len(self._last) >= self._cap:
                self._last.clear()
            self._last[(peer, kind)] = now
        self._logger.warning(msg, *args)
        return True
