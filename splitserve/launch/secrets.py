"""The keys a deployment runs with, made by the launcher so that nobody has to type one.

Runs in the ``splitserve up`` process. Every start writes fresh keys under the run directory's
``secrets/`` (directory 0700, files 0600, created with those modes) and hands them to the
processes through their environment, never their command lines (docs/security.md):

- the side-channel key (``SPLITSERVE_AUTH_KEY_FILE`` names the file): the P and D connectors
  admit only peers that hold it;
- the engines' API key (``VLLM_API_KEY``, read by vLLM's API server): an engine's ``/v1``
  routes answer only the proxy, which sends it as ``upstream_api_key`` (written to the proxy's
  own 0600 config file).

A deployment that brings its own side-channel key (``connector.settings.auth_key_file``) keeps
it; ``connector.settings.insecure: true`` runs the side channel without one (a trusted lab).

A deployment placed on several hosts (``PoolSettings.hosts``) needs the same keys on every host,
so there the keys are made once and then reused: a key file already in ``secrets/`` is read, a
missing one is made atomically (written aside, then linked into place: two ``up`` sharing a
file system agree on one key). The user copies ``secrets/`` to each machine (docs/deployment.md).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from splitserve.config import Deployment, DeploymentError
from splitserve.transfer.auth import KEY_FILE_ENV, generate_key, write_key_file

ENGINE_API_KEY_ENV = "VLLM_API_KEY"


@dataclass(frozen=True)
class DeploymentSecrets:
    side_channel_key_file: Path | None
    engine_api_key_file: Path
    engine_api_key: str

    @classmethod
    def create(cls, dep: Deployment, run_dir: Path) -> DeploymentSecrets:
        """The keys of this start (files 0600 in ``run_dir/secrets``, a 0700 directory): fresh
        ones, or for a deployment placed on hosts the ones already there (made if missing)."""
        folder = (run_dir / "secrets").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        make = _existing_or_new if dep.placed else _fresh
        side = None
        if needs_side_channel_key(dep):
            side, _ = make(folder / "side-channel.key")
        engine_file, engine_key = make(folder / "engine-api.key")
        return cls(side, engine_file, engine_key)

    def engine_env(self) -> dict[str, str]:
        """What every engine process gets in its environment."""
        env = {ENGINE_API_KEY_ENV: self.engine_api_key}
        if self.side_channel_key_file is not None:
            env[KEY_FILE_ENV] = str(self.side_channel_key_file)
        return env

    def printable_env(self) -> dict[str, str]:
        """``engine_env`` as shell text that reads the keys from their files (for
        ``--print-commands``: the printout holds no key)."""
        env = {ENGINE_API_KEY_ENV: f'"$(cat {self.engine_api_key_file})"'}
        if self.side_channel_key_file is not None:
            env[KEY_FILE_ENV] = str(self.side_channel_key_file)
        return env


def _fresh(path: Path) -> tuple[Path, str]:
    key = generate_key()
    return write_key_file(path, key), key


def _existing_or_new(path: Path) -> tuple[Path, str]:
    """The key in ``path``; if there is none, a fresh one linked into place atomically (a
    concurrent maker's key wins and is the one returned)."""
    if not path.exists():
        aside = path.with_name(f".{path.name}.{os.getpid()}")
        write_key_file(aside, generate_key())
        try:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
        finally:
            aside.unlink(missing_ok=True)
    key = path.read_text().strip()
    if not key:
        raise DeploymentError(f"{path}: empty key file (remove it to have a new key made)")
    return path, key


def needs_side_channel_key(dep: Deployment, ignore_key_file: bool = False) -> bool:
    """Whether the launcher makes a side-channel key: the splitserve connector, not insecure,
    and (unless ``ignore_key_file``: the Kubernetes manifests, where a local file means
    nothing) no key file of the deployment's own."""
    settings = dep.connector.settings
    return (
        dep.connector.name == "splitserve"
        and not settings.get("insecure", False)
        and (ignore_key_file or not settings.get("auth_key_file"))
    )
