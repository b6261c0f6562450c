"""Engine-agnostic KV transport over NIXL: the layer-wise push protocol's two halves.

Nothing here imports vLLM or SGLang; the engine adapters (``splitserve.connectors.*``) drive it.

- ``messages``: every control message, typed, versioned, HMAC'd when an auth key is set.
- ``layout``: where each (layer, block) lives in memory; validation of block ids.
- ``agent``: the NIXL agent (registration, prepared descriptor lists, WRITE/READ posting).
- ``side_channel``: ZMQ control channel (HELLO / REGISTER / ABORT), peer-death detection.
- ``state``: one enum of transfer states and the one place where they change.
- ``strategy``: push or pull, per transport.
- ``sender`` (P) and ``receiver`` (D): the protocol itself.
"""
