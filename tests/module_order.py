"""The order of the integration modules (tests/conftest.py sorts the session by it), in a
module of its own so that the start-ahead schedule (tests/integration/starters.py) reads the
same names."""

# Integration modules that start no engine server and keep about one core busy (measured:
# 49.5% of two cores over their 157 s, session 29). They run right before the SGLang modules,
# whose servers start meanwhile on the idle core (tests/integration/starters.py, ``AHEAD``).
LIGHT_MODULES = [
    "test_transfer_two_process.py",
    "test_transfer_cross_host.py",
    "test_transfer_tp_slices.py",
    "test_transfer_progress.py",
    "test_peer_pruning_nixl.py",
    "test_gpu_proof_cpu.py",
    "test_planner_calibrate.py",
    "test_testbed.py",
]

# Integration modules run in this order (unit tests first; modules not listed run last, in
# their usual order): modules that share servers run next to each other, so a shared server is
# still running when the next module asks for it instead of being stopped and started again.
INTEGRATION_ORDER = [
    "test_smoke_vllm.py",  # "unified" (started ahead, during the unit tests)
    "test_adaptive_scheduler.py",  # "unified", "adaptive-scheduler" (ahead, likewise)
    "test_proxy_vllm.py",  # stock NIXL pair (ahead, likewise); kills "unified" (its last user)
    "test_connector_vllm.py",  # "ss-a", "ss-b"
    "test_proxy_splitserve.py",  # "ss-a", "ss-b"
    "test_proxy_decide.py",  # "ss-a", "ss-b"
    "test_discovery.py",  # "ss-a", "ss-b", "ss-c"
    "test_prefill_allowlist.py",  # "ss-a", "ss-b", "ss-c"
    "test_control_plane.py",  # "ss-a", "ss-b"; the SGLang pair and single start from here on
    *LIGHT_MODULES,  # no engine server
    "test_sglang_pd.py",  # SGLang PD pair + router (tests/integration/conftest.py)
    "test_proxy_sglang.py",  # the same pair
    "test_sglang_failures.py",  # the same pair (its last user), "sglang-single" as reference;
    # the adaptive SGLang server starts meanwhile
    "test_sglang_server.py",
    "test_engines_cross_host.py",  # "sglang-single" as reference; its own test-bed pairs
    "test_up.py",  # its own deployment, not the pool; the fault matrix's servers start meanwhile
    "test_fault_matrix.py",  # its own four servers (fm-*); LMCache's start meanwhile
    "test_lmcache.py",
    "test_serving_cross_host.py",
    "test_soak.py",
    "test_tensor_parallel.py",
    "test_up_cross_host.py",
]
