"""Engine-agnostic KV transport over NIXL: the two halves of the layer-wise transfer.

KV streams from P to D layer by layer while P computes; who copies each layer's bytes is the
direction (``strategy``): push (P WRITEs; the default on RDMA, device memory and ``tcp``) or
pull (P ANNOUNCEs, D READs; the default on host memory over UCX's ``cma``). Nothing here imports
vLLM or SGLang; the engine adapters (``splitserve.connectors.*``) drive it.

- ``messages``: every control message, typed, versioned, HMAC'd when an auth key is set.
- ``auth``: the deployment key (where it is read from), the CurveZMQ key pairs derived from it
  and the check that admits only key holders (docs/security.md).
- ``peers``: which prefill hosts a decode side may contact (``allowed_prefill_hosts``).
- ``peering``: which receiver a sender's connection speaks for (HELLO admission).
- ``layout``: where each (layer, block) lives in memory; validation of block ids.
- ``agent``: the NIXL agent (registration, prepared descriptor lists, WRITE/READ posting,
  ``settle`` of posted transfers, peers' layouts).
- ``side_channel``: ZMQ control channel (HELLO / REGISTER / ABORT ...), peer-death detection.
- ``state``: one enum of transfer states and the one place where they change.
- ``strategy``: push or pull, per transport.
- ``sender`` (P): ``KVSender``, the protocol for both directions, over ``outgoing`` (its
  per-transfer record, ``StepUpdate``, ``SenderStats``, the strategy interface) and the two
  direction strategies ``send_push`` (WRITEs, DONE on the final WRITE) and ``send_pull``
  (ANNOUNCEs, DONE on the side channel, free on D's PULLED).
- ``receiver`` (D): ``KVReceiver``, the protocol for both directions, over ``incoming`` (its
  per-transfer record, ``Outcome``, ``ReceiverStats``) and ``recv_push`` (DONE from the
  notification on P's last WRITE) and ``recv_pull`` (READs of what P announces, DONE or the
  first token on the side channel, PULLED).
"""
