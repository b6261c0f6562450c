"""The transfer counters both engine adapters export, by name, with what each counts.

Engine-free, so the vLLM connector (``connectors.vllm.stats``, which imports vLLM) and the
SGLang backend (``connectors.sglang.stats``) share one catalogue: the same name means the same
thing on either engine's ``/metrics``. SGLang's push-only backend exports a subset.
"""

from __future__ import annotations

COUNTERS: dict[str, str] = {
    "bytes_sent": "Bytes of KV written to decode servers (push) or announced for them to read "
    "(pull)",
    "writes_posted": "NIXL WRITE transfers posted (one per layer per step, or one bulk)",
    "transfers_completed": "Prefill-side transfers completed (DONE delivered)",
    "transfers_failed": "Prefill-side transfers failed (WRITE error, invalid registration)",
    "transfers_aborted": "Prefill-side transfers aborted (by the decode side or the engine)",
    "lease_expiries": "Prefill-side requests freed because no registration came in the lease",
    "registrations_received": "Registrations received from decode servers (any outcome)",
    "registrations_rejected": "Registrations refused (unknown id, bad block ids, no HELLO)",
    "messages_rejected": "Control messages and side-channel connections refused (a failed "
    "CurveZMQ handshake: no or another key; bad HMAC, malformed, oversized, wrong version)",
    "transfers_stalled": "Prefill-side transfers failed because no post completed within the "
    "lease (a transport gone silent); their posts were cancelled",
    "reads_cancelled": "Decode-side READs of an ended load cancelled because they did not "
    "settle within abort_ack_timeout_s",
    "peers_dropped": "Side-channel connections this server opened and dropped: unreachable, "
    "silent (heartbeats), key mismatch, or a peer that stopped reading",
    "loads_completed": "Decode-side loads completed",
    "loads_failed": "Decode-side loads failed (ABORT, timeout, prefill side lost)",
    "done_timeouts": "Decode-side loads that saw no DONE within done_timeout_s",
    "post_seconds": "Seconds this server spent inside its transfer posts: as prefill side its "
    "WRITEs (push; over UCX cma the copy itself runs in the post) or ANNOUNCEs (pull), as decode "
    "side its READs (pull; over cma the copy, on the decode server)",
    "announces_sent": "ANNOUNCE messages sent to decode servers (pull: one per layer per step, "
    "or one bulk)",
    "reads_posted": "NIXL READ transfers posted from prefill servers' memory (pull: one per "
    "ANNOUNCE)",
    "bytes_read": "Bytes of KV read from prefill servers (pull)",
    "first_tokens_relayed": "First output tokens this prefill server's side channel relayed "
    "from its engine straight to a decode server (pull, first token from prefill)",
    "loads_completed_on_first_token": "Decode-side loads completed on the prefill engine's "
    "relayed first token, before (without) its DONE",
    "layers_posted_in_forward": "Layers the engine's per-layer hook reported during a prefill "
    "step with transfers in it, posted while the forward ran (the layer-wise overlap)",
    "layers_posted_at_step_end": "Layers the per-layer hook never reported, which the end of "
    "the step had to post after the forward (zero while the hook fires)",
}
