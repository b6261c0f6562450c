"""Kubernetes manifests from the deployment files (``splitserve up CONFIG --emit kubernetes
DIR``): every shipped config's manifests pass the Kubernetes API schemas of a current release
(``kubernetes-validate``, strict: an unknown field is an error), one config's are kept as golden
files, the keys live only in the Secret, and the engines run the command ``splitserve up`` runs.

Update the golden files after a reviewed change with SPLITSERVE_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from splitserve.cli import cli
from splitserve.config import DeploymentError, load_deployment, parse_deployment
from splitserve.launch.deployment import plan_servers
from splitserve.launch.kubernetes import (
    ENGINE_API_KEY,
    PROXY_API_KEY,
    SIDE_CHANNEL_KEY,
    build_manifests,
    gpus_per_server,
)
from splitserve.launch.kubernetes_drain import busy

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden" / "kubernetes" / "llama-70b-2p2d-gpu"
K8S_VERSION = "1.37.0"  # the newest release kubernetes-validate ships schemas for (dev extra pin)
NORMALISED = {SIDE_CHANNEL_KEY: "<generated>", ENGINE_API_KEY: "<generated>",
              PROXY_API_KEY: "<generated>"}  # fmt: skip


def test_schemas_are_a_current_release() -> None:
    assert kubernetes_validate.latest_version() == K8S_VERSION


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates_against_the_api_schemas(config: Path, tmp_path) -> None:
    dep = load_deployment(config)
    written = build_manifests(dep, str(config)).write(tmp_path)
    kinds = []
    for path in written:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] == "Kustomization":
                assert sorted(doc["resources"]) == sorted(
                    p.name for p in written if p.name != "kustomization.yaml"
                )
                continue
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            kinds.append((doc["kind"], doc["metadata"]["name"]))
    prefix = dep.name.lower()
    for role in ("prefill", "decode"):
        for kind in ("Deployment", "Service", "PodDisruptionBudget"):
            assert (kind, f"{prefix}-{role}") in kinds
    for kind in ("Deployment", "Service", "ConfigMap"):
        assert (kind, f"{prefix}-proxy") in kinds
    assert ("Secret", f"{prefix}-keys") in kinds


def test_schema_check_rejects_a_broken_manifest() -> None:
    """The check above can fail: a misspelt field is refused."""
    dep = load_deployment(ROOT / "configs" / "demo-cpu.yaml")
    doc = build_manifests(dep).files["decode.yaml"][1]
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _texts(manifests) -> dict[str, str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return {p.name: p.read_text() for p in manifests.write(Path(d))}


def test_golden_files_of_the_2p2d_gpu_fleet() -> None:
    dep = load_deployment(ROOT / "configs" / "llama-70b-2p2d-gpu.yaml")
    texts = _texts(build_manifests(dep, keys=NORMALISED))
    if os.environ.get("SPLITSERVE_UPDATE_GOLDEN"):
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (GOLDEN / name).write_text(text)
    assert sorted(p.name for p in GOLDEN.iterdir()) == sorted(texts)
    for name, text in texts.items():
        assert text == (GOLDEN / name).read_text(), f"{name} changed: review, then update"


def test_keys_only_in_the_secret_and_pods_read_them_from_it() -> None:
    dep = load_deployment(ROOT / "configs" / "demo-cpu.yaml")
    manifests = build_manifests(dep)
    texts = _texts(manifests)
    secret = manifests.files["secret.yaml"][0]
    keys = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(keys) == {SIDE_CHANNEL_KEY, ENGINE_API_KEY, PROXY_API_KEY}
    assert len(set(keys.values())) == 3 and all(len(v) >= 32 for v in keys.values())
    for name, text in texts.items():
        for value in keys.values():
            assert value not in text, f"a key in plain text in {name}"
            if name != "secret.yaml":
                assert base64.b64encode(value.encode()).decode() not in text
    pod = manifests.files["prefill.yaml"][1]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["SPLITSERVE_AUTH_KEY_FILE"]["value"] == f"/etc/splitserve/keys/{SIDE_CHANNEL_KEY}"
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == ENGINE_API_KEY
    assert pod["volumes"][0]["secret"]["secretName"] == secret["metadata"]["name"]
    proxy = yaml.safe_load(manifests.files["proxy.yaml"][0]["data"]["proxy.yaml"])
    assert proxy["api_key_file"].endswith(PROXY_API_KEY)
    assert proxy["upstream_api_key_file"].endswith(ENGINE_API_KEY)
    assert build_manifests(dep).files["secret.yaml"][0]["data"] != secret["data"], "fresh keys"


def _pod_view(argv: list[str]) -> tuple[list[str], dict]:
    """argv without its interpreter and host, and its KV config without the addresses (the pod
    binds every address and names its own IP; a loopback allowlist of prefill hosts is a
    single-host deployment's)."""
    argv = list(argv)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = kv.get("kv_connector_extra_config", {})
    for key in ("side_channel_host", "allowed_prefill_hosts"):
        extra.pop(key, None)
    argv[argv.index("--kv-transfer-config") + 1] = "<kv>"
    argv[argv.index("--host") + 1] = "<host>"
    return argv[1:], kv


@pytest.mark.parametrize("config", ["demo-cpu.yaml", "llama-70b-2p2d-gpu.yaml"])
def test_engines_run_the_command_up_runs(config: str) -> None:
    """The pod's command is ``splitserve up``'s for server 0, with the pod's addresses."""
    dep = load_deployment(ROOT / "configs" / config)
    manifests = build_manifests(dep)
    for role in ("prefill", "decode"):
        pod = manifests.files[f"{role}.yaml"][1]["spec"]["template"]["spec"]
        argv = pod["containers"][0]["command"]
        model = argv[argv.index("--model") + 1]
        local = next(s for s in plan_servers(dep, model) if s.name == f"{role}-0")
        assert argv[0] == "python" and argv[argv.index("--host") + 1] == "0.0.0.0"
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector_extra_config"]["side_channel_host"] == "$(POD_IP)"
        assert _pod_view(argv) == _pod_view(local.command.argv)


def test_gpus_per_pod_follow_the_parallel_sizes() -> None:
    dep = load_deployment(ROOT / "configs" / "llama-70b-2p2d-gpu.yaml")
    pod = build_manifests(dep).files["decode.yaml"][1]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    base = {"base_port": 8100}
    from splitserve.config import PoolSettings

    assert (
        gpus_per_server(PoolSettings(**base, args=["-tp", "4", "--pipeline-parallel-size=2"])) == 8
    )
    assert gpus_per_server(PoolSettings(**base, gpus=["0,1,2"])) == 3
    assert gpus_per_server(PoolSettings(**base)) == 1


def _demo(**kubernetes) -> dict:
    data = yaml.safe_load((ROOT / "configs" / "demo-cpu.yaml").read_text())
    data["kubernetes"] = kubernetes
    return data


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"image": "Not An Image"}, "kubernetes.image: .*not an image reference"),
        ({"node_selectors": {"decode": {"-bad": "x"}}}, "kubernetes.node_selectors.decode"),
        ({"resources": {"prefill": {"memory": "8 GB"}}}, "kubernetes.resources.prefill.memory"),
        ({"namespace": "Prod"}, "kubernetes.namespace"),
        ({"name": "9lives"}, "kubernetes.name"),
        ({"imagee": "x"}, "kubernetes.imagee: Extra inputs"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_field(settings: dict, fragment: str) -> None:
    dep = parse_deployment(_demo(**settings), "dep.yaml")
    with pytest.raises(DeploymentError, match=f"dep.yaml: {fragment}"):
        build_manifests(dep, "dep.yaml")


def test_settings_reach_the_manifests() -> None:
    dep = parse_deployment(
        _demo(
            image="registry.example/splitserve:0.3",
            namespace="llm",
            node_selectors={"decode": {"pool": "decode-nodes"}},
            drain_timeout_s=600,
        )
    )
    m = build_manifests(dep)
    pod = m.files["decode.yaml"][1]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/splitserve:0.3"
    assert pod["nodeSelector"] == {"pool": "decode-nodes"}
    assert pod["terminationGracePeriodSeconds"] == 15 + 600 + 30
    assert m.files["kustomization.yaml"][0]["namespace"] == "llm"


def test_a_deployment_placed_on_hosts_is_refused_naming_the_keys() -> None:
    """Pods get their addresses from Kubernetes: placing servers on hosts cannot be emitted."""
    data = _demo()
    data["prefill"].update(hosts=["10.0.0.1"], side_channel_base_port=5701)
    data["decode"].update(hosts=["10.0.0.2"], side_channel_base_port=5701)
    data["proxy"].update(host="10.0.0.3", insecure=True)  # the refusal is not about the key
    dep = parse_deployment(data, "dep.yaml")
    assert dep.placed
    with pytest.raises(DeploymentError, match="dep.yaml: prefill.hosts, decode.hosts and proxy"):
        build_manifests(dep, "dep.yaml")


def test_cli_emits_a_directory(tmp_path) -> None:
    result = CliRunner().invoke(
        cli, ["up", str(ROOT / "configs" / "demo-cpu.yaml"), "--emit", "kubernetes", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode.yaml", "kustomization.yaml", "prefill.yaml", "proxy.yaml", "secret.yaml",
    ]  # fmt: skip
    assert "kubectl apply -k" in result.output


def test_drain_counts_running_waiting_and_held_kv() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{model_name="m"} 0.0\n'
        'vllm:num_requests_waiting{model_name="m"} 0.0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
        'vllm:prompt_tokens_total{model_name="m"} 12.0\n'
    )
    assert busy(text) == 0
    assert (
        busy(text.replace('kv_cache_usage_perc{model_name="m"} 0.0', "kv_cache_usage_perc 0.25"))
        == 0.25
    )
    assert busy(text.replace('running{model_name="m"} 0.0', 'running{model_name="m"} 2.0')) == 2
