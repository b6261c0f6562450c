"""Unit tests of our own command building for vLLM servers (``splitserve.launch.engines``):
pure string and environment logic, no engine started."""

from __future__ import annotations

import pytest

from splitserve.launch.engines import CPU_EAGER_ENV, tensor_parallel_size, vllm_server


@pytest.mark.parametrize(
    ("argv", "size"),
    [
        ([], 1),
        (["--max-model-len", "2048"], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--tensor-parallel-size=4"], 4),
        (["-tp", "8"], 8),
        (["--tensor-parallel-size"], 1),  # no value: vLLM's parser reports it
        (["--tensor-parallel-size", "two"], 1),
    ],
)
def test_tensor_parallel_size_from_the_command_line(argv, size):
    assert tensor_parallel_size(argv) == size


def test_a_tp_cpu_server_runs_eager_and_binds_every_rank_to_its_core():
    cmd = vllm_server("m", 8000, extra_args=["--tensor-parallel-size", "2"], cpu_core=1)
    assert cmd.env["TORCHDYNAMO_DISABLE"] == CPU_EAGER_ENV["TORCHDYNAMO_DISABLE"] == "1"
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "1|1"


def test_a_tp_1_cpu_server_runs_eager_too_with_one_core_list():
    cmd = vllm_server("m", 8000, cpu_core=0)
    assert cmd.env["TORCHDYNAMO_DISABLE"] == "1"
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_the_callers_environment_wins_and_gpu_servers_get_nothing_of_it():
    cmd = vllm_server(
        "m",
        8000,
        extra_args=["-tp", "2"],
        env={"TORCHDYNAMO_DISABLE": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        cpu_core=0,
    )
    assert cmd.env["TORCHDYNAMO_DISABLE"] == "0"
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    gpu = vllm_server("m", 8000, extra_args=["-tp", "2"], cpu=False)
    assert "TORCHDYNAMO_DISABLE" not in gpu.env


def test_cpu_servers_poll_their_rings_unless_someone_else_set_the_spin(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_VLLM_SHM_SPIN_S", raising=False)
    assert vllm_server("m", 8000).env["SPLITSERVE_VLLM_SHM_SPIN_S"] == "0"
    assert "SPLITSERVE_VLLM_SHM_SPIN_S" not in vllm_server("m", 8000, cpu=False).env
    caller = vllm_server("m", 8000, env={"SPLITSERVE_VLLM_SHM_SPIN_S": "0.5"})
    assert caller.env["SPLITSERVE_VLLM_SHM_SPIN_S"] == "0.5"
    # set in the launcher's own environment: the child inherits that value, not ours
    monkeypatch.setenv("SPLITSERVE_VLLM_SHM_SPIN_S", "1")
    assert "SPLITSERVE_VLLM_SHM_SPIN_S" not in vllm_server("m", 8000).env


def test_in_process_worker_only_for_one_rank_without_an_explicit_executor():
    flag = "VLLM_ENABLE_V1_MULTIPROCESSING"
    assert flag not in vllm_server("m", 8000).env  # vLLM's own default unless asked
    assert vllm_server("m", 8000, in_process_worker=True).env[flag] == "0"
    assert vllm_server("m", 8000, in_process_worker=True, cpu=False).env[flag] == "0"
    several = vllm_server("m", 8000, extra_args=["-tp", "2"], in_process_worker=True)
    assert flag not in several.env
    for explicit in (
        ["--distributed-executor-backend", "mp"],
        ["--distributed-executor-backend=mp"],
    ):
        assert flag not in vllm_server("m", 8000, extra_args=explicit, in_process_worker=True).env
