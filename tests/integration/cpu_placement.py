"""Where a test server's threads run on our 2 cores.

A third server of a pinned pair runs unpinned with one OpenMP thread: pinned beside a server
that computes (ss-a prefilling, say), the two engines' OpenMP threads share one core and spin
against each other; P's side channel then misses its 5 s handshake and heartbeat bounds
(connector-protocol.md), and a step was once stalled for 60 s.
"""

UNPINNED = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
