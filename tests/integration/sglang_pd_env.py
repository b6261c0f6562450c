"""The shared SGLang PD pair's keys and environment (the ``sglang_pair`` fixture,
tests/integration/conftest.py), in a module of its own so that the modules that run faults on
that pair (test_sglang_failures.py) read the same values."""

# The shared SGLang PD pair's environment: also test_sglang_failures.py's (it runs its faults on
# this pair), so a lease short enough for a freeze to outlast it (docs/sglang.md, "Failures").
SGLANG_LEASE_S = 10.0
SGLANG_PD_ENV = {
    "SPLITSERVE_SGLANG_TIMELINE": "1",  # the per-request timeline in the logs (test_sglang_pd)
    "SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "120",
    "SPLITSERVE_SGLANG_LEASE_S": str(SGLANG_LEASE_S),
}
# D's own heartbeats to P's bootstrap server (SGLang's, 5 s by default) are stretched past any
# test: a D must recover from a P restarted on its ports through our backend alone (a fast
# restart answers those heartbeats again before they count P lost).
SGLANG_D_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "3600"}
SGLANG_PD_KEYS = ("sglang-pd-prefill", "sglang-pd-decode")
