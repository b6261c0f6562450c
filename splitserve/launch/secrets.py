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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from splitserve.config import Deployment
from splitserve.transfer.auth import KEY_FILE_ENV, generate_key, write_key_file

ENGINE_API_KEY_ENV = "VLLM_API_KEY"


@dataclass(frozen=True)
class DeploymentSecrets:
    side_channel_key_file: Path | None
    engine_api_key_file: Path
    engine_api_key: str

    @classmethod
    def create(cls, dep: Deployment, run_dir: Path) -> DeploymentSecrets:
        """Fresh keys for this start (files 0600 in ``run_dir/secrets``, a 0700 directory)."""
        folder = (run_dir / "secrets").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        side = None
        if needs_side_channel_key(dep):
            side = write_key_file(folder / "side-channel.key")
        engine_key = generate_key()
        engine_file = write_key_file(folder / "engine-api.key", engine_key)
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
