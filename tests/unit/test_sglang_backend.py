"""The ``splitserve`` SGLang transfer backend without servers: the plugin makes the backend name
parse with SGLang's real argument parser and resolve to our classes; SGLang's buffers become a
``KVLayout`` (KV buffers, then aux rows); model layers map to their K and V buffers; settings
are read from the environment with errors that name the variable; the prefill manager keeps one
record per transfer (``bootstrap_room`` converted once) and fails through one path."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from splitserve.connectors.sglang.timeline import Timeline
from splitserve.connectors.sglang.transport import (
    BackendSettings,
    BackendSettingsError,
    layout_from_buffers,
    layout_layers_of_model_layers,
)
from splitserve.transfer.state import TransferState


def test_layout_from_sglang_buffers():
    layout = layout_from_buffers(
        kv_ptrs=[0x1000, 0x9000],
        kv_lens=[4096, 4096],
        kv_item_lens=[256, 256],
        aux_ptrs=[0x20000, 0x30000],
        aux_lens=[64 * 10, 8 * 10],
        aux_item_lens=[64, 8],
        page_size=4,
        memory="DRAM",
    )
    assert layout.block_size == 4 and layout.aux_layers == 2 and layout.num_kv_layers == 2
    assert layout.num_blocks == 16
    assert [layer.num_blocks for layer in layout.layers] == [16, 16, 10, 10]
    assert layout.layers[2].runs == ((0, 64),)
    layout.validate_block_ids([9], "aux", 3)
    with pytest.raises(ValueError):
        layout.validate_block_ids([10], "aux", 3)


def test_layout_rejects_inconsistent_buffers():
    with pytest.raises(ValueError):
        layout_from_buffers(
            kv_ptrs=[1],
            kv_lens=[8],
            kv_item_lens=[16],
            aux_ptrs=[],
            aux_lens=[],
            aux_item_lens=[],
            page_size=1,
            memory="DRAM",
        )


def test_model_layers_map_to_their_k_and_v_buffers():
    assert layout_layers_of_model_layers(6, [], 0) == {0: [0, 3], 1: [1, 4], 2: [2, 5]}
    assert layout_layers_of_model_layers(4, [], 10) == {10: [0, 2], 11: [1, 3]}
    assert layout_layers_of_model_layers(3, [5, 5, 7], 0) == {5: [0, 1], 7: [2]}
    with pytest.raises(ValueError):
        layout_layers_of_model_layers(3, [], 0)


def test_settings_from_environment():
    assert BackendSettings.from_env({}).layerwise is True
    settings = BackendSettings.from_env(
        {
            "SPLITSERVE_SGLANG_LAYERWISE": "0",
            "SPLITSERVE_SGLANG_LEASE_S": "12.5",
            "SPLITSERVE_SGLANG_UCX_PARAMS": '{"ucx_error_handling_mode": "none"}',
        }
    )
    assert settings.layerwise is False and settings.lease_s == 12.5
    assert settings.ucx_params == {"ucx_error_handling_mode": "none"}
    with pytest.raises(BackendSettingsError, match="SPLITSERVE_SGLANG_DONE_TIMEOUT_S"):
        BackendSettings.from_env({"SPLITSERVE_SGLANG_DONE_TIMEOUT_S": "-1"})
    with pytest.raises(BackendSettingsError, match="UCX_PARAMS"):
        BackendSettings.from_env({"SPLITSERVE_SGLANG_UCX_PARAMS": "{"})


def test_plugin_registers_the_backend_name_and_classes():
    pytest.importorskip("sglang.srt.disaggregation.utils")
    import argparse

    from sglang.srt.disaggregation import utils as disagg_utils
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    from splitserve import plugins
    from splitserve.connectors.sglang import conn

    plugins.register_sglang()
    HookRegistry.apply_hooks()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--model-path", "m", "--disaggregation-transfer-backend", "splitserve"]
    )
    assert args.disaggregation_transfer_backend == "splitserve"
    backend = disagg_utils.TransferBackend("splitserve")
    kinds = disagg_utils.KVClassType
    assert disagg_utils.get_kv_class(backend, kinds.MANAGER) is conn.SplitserveKVManager
    assert disagg_utils.get_kv_class(backend, kinds.SENDER) is conn.SplitserveKVSender
    assert disagg_utils.get_kv_class(backend, kinds.RECEIVER) is conn.SplitserveKVReceiver
    assert (
        disagg_utils.get_kv_class(backend, kinds.BOOTSTRAP_SERVER)
        is conn.SplitserveKVBootstrapServer
    )


# -- the manager's records (P), without a server ---------------------------------------------


class _Sender:
    """Stands in for ``KVSender``: registrations and settled transfers a test hands it."""

    def __init__(self):
        self.registrations: dict = {}
        self.settled: dict = {}
        self.calls: list[tuple] = []
        self.stats = SimpleNamespace(
            transfers_completed=0,
            writes_posted=0,
            bytes_sent=0,
            layers_posted_in_forward=0,
            layers_posted_at_step_end=0,
        )

    def poll_settled(self):
        settled, self.settled = self.settled, {}
        return settled

    def registration_of(self, transfer_id):
        return self.registrations.get(transfer_id)

    def cancelled(self, transfer_id):
        return False

    def add_request(self, transfer_id, num_tokens, aux_row=None):
        self.calls.append(("add", transfer_id, num_tokens))

    def cancel(self, transfer_id, reason):
        self.calls.append(("cancel", transfer_id))

    def begin_step(self, updates):
        self.calls.append(("step", [(u.transfer_id, list(u.block_ids)) for u in updates]))

    def end_step(self):
        pass

    def finish_request(self, transfer_id):
        self.calls.append(("finish", transfer_id))


def _manager():
    """A prefill manager over a fake sender; SGLang's own bookkeeping recorded as it is."""
    conn = pytest.importorskip("splitserve.connectors.sglang.conn")
    from sglang.srt.disaggregation.base.conn import KVPoll

    mgr = conn.SplitserveKVManager.__new__(conn.SplitserveKVManager)
    mgr.lock = threading.RLock()
    mgr.sender, mgr.receiver = _Sender(), None
    mgr.transfers, mgr.layers_hooked, mgr.forward_open = {}, 0, False
    mgr.timeline, mgr.metrics, mgr.handoffs_s = Timeline(False), None, []
    mgr.kv_args = SimpleNamespace(page_size=4)
    mgr.request_status, mgr.req_to_decode_prefix_len, mgr.failures = {}, {}, {}
    mgr.update_status = mgr.request_status.__setitem__
    mgr.record_failure = mgr.failures.__setitem__
    return conn, mgr, KVPoll


def test_manager_keeps_one_record_per_transfer_and_ends_it_once():
    conn, mgr, poll = _manager()
    room = 2**62 + 7  # SGLang's bootstrap_room: an int at the edge, a str transfer id inside
    transfer_id = str(room)
    mgr.await_registration(transfer_id)
    mgr.request_status[room] = poll.Bootstrapping
    mgr.drive()
    assert mgr.transfers[transfer_id].phase is conn.Phase.AWAITING_REGISTRATION
    mgr.sender.registrations[transfer_id] = SimpleNamespace(token_offset=4)
    mgr.drive()
    assert mgr.request_status[room] == poll.WaitingForInput
    assert mgr.req_to_decode_prefix_len[room] == 4 and mgr.transfers == {}
    mgr.start_request(transfer_id, num_pages=2, aux_index=0)
    assert ("add", transfer_id, 12) in mgr.sender.calls, "one page below the prefix"
    mgr.add_transfer_request(room, [8, 9], slice(0, 2), is_last_chunk=True)
    assert ("step", [(transfer_id, [0, 8, 9])]) in mgr.sender.calls
    assert ("finish", transfer_id) in mgr.sender.calls
    assert mgr.request_status[room] == poll.Transferring
    mgr.sender.settled[transfer_id] = SimpleNamespace(state=TransferState.COMPLETED)
    mgr.drive()
    assert mgr.request_status[room] == poll.Success and mgr.transfers == {}


def test_manager_fails_through_one_path_and_forgets_the_transfer():
    conn, mgr, poll = _manager()
    room, transfer_id = 11, "11"
    mgr.start_request(transfer_id, num_pages=1, aux_index=None)
    mgr.add_transfer_request(room, [3], slice(1, 2), is_last_chunk=False)  # a gap
    assert mgr.request_status[room] == poll.Failed
    assert "chunk starts at page 1" in mgr.failures[room]
    assert ("cancel", transfer_id) in mgr.sender.calls
    failed = SimpleNamespace(state=TransferState.FAILED, reason="D lost")
    mgr.sender.settled[transfer_id] = failed
    mgr.drive()
    assert "D lost" in mgr.failures[room] and mgr.transfers == {}
    # A sender SGLang concluded itself (bootstrap timeout) leaves no record behind.
    mgr.await_registration("12")
    mgr.request_status[12] = poll.Failed
    mgr.drive()
    assert mgr.transfers == {}


def test_a_prefill_side_channel_on_the_network_needs_a_key(monkeypatch, tmp_path) -> None:
    from splitserve.connectors.sglang.transport import side_channel_key
    from splitserve.transfer.auth import write_key_file

    for name in ("SPLITSERVE_AUTH_KEY", "SPLITSERVE_AUTH_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    plain = BackendSettings.from_env({})
    assert side_channel_key(plain, "127.0.0.1", prefill=True) is None
    assert side_channel_key(plain, "10.0.0.5", prefill=False) is None  # D binds nothing
    with pytest.raises(BackendSettingsError, match="no auth key") as err:
        side_channel_key(plain, "10.0.0.5", prefill=True)
    assert "SPLITSERVE_SGLANG_INSECURE" in str(err.value)
    lab = BackendSettings.from_env({"SPLITSERVE_SGLANG_INSECURE": "1"})
    assert side_channel_key(lab, "10.0.0.5", prefill=True) is None
    with pytest.raises(BackendSettingsError, match="SGLANG_HOST_IP"):
        side_channel_key(lab, "0.0.0.0", prefill=True)
    key_file = write_key_file(tmp_path / "k")
    keyed = BackendSettings.from_env({"SPLITSERVE_SGLANG_AUTH_KEY_FILE": str(key_file)})
    assert (
        side_channel_key(keyed, "10.0.0.5", prefill=True) == key_file.read_text().strip().encode()
    )


def test_decode_allowlist_of_prefill_hosts() -> None:
    from splitserve.connectors.sglang.transport import prefill_allowlist

    assert prefill_allowlist(BackendSettings.from_env({})) is None
    env = {"SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS": "10.1.0.0/16, p0.pool"}
    allowlist = prefill_allowlist(BackendSettings.from_env(env))
    assert allowlist.allows("10.1.9.9") and allowlist.allows("P0.pool")
    assert not allowlist.allows("10.2.0.1")
    with pytest.raises(BackendSettingsError, match="ALLOWED_PREFILL_HOSTS"):
        prefill_allowlist(
            BackendSettings.from_env({"SPLITSERVE_SGLANG_ALLOWED_PREFILL_HOSTS": "a b"})
        )


def test_an_early_send_inside_the_forward_leaves_the_layer_wise_step_open():
    """SGLang sends a cached prefix from inside ``run_batch``, after ``begin_forward`` opened the
    layer-wise step: a step of its own would close the forward's (its layers then posted only
    after it); the pages join the page table and the open step posts them."""
    conn, mgr, poll = _manager()
    room, transfer_id = 21, "21"
    mgr.start_request(transfer_id, num_pages=3, aux_index=None)
    mgr.forward_open = True
    mgr.add_transfer_request(room, [5, 6], slice(0, 2), is_last_chunk=False)
    assert not [call for call in mgr.sender.calls if call[0] == "step"]
    assert mgr.transfers[transfer_id].pages == [5, 6]
    mgr.forward_open = False
    mgr.add_transfer_request(room, [7], slice(2, 3), is_last_chunk=True)
    assert ("step", [(transfer_id, [5, 6, 7])]) in mgr.sender.calls
    assert ("finish", transfer_id) in mgr.sender.calls


def _receiver(state, pool: dict, entries: dict):
    """A decode receiver that concluded in ``state``, over SGLang's real ``poll`` and cache."""
    conn = pytest.importorskip("splitserve.connectors.sglang.conn")
    recv = conn.SplitserveKVReceiver.__new__(conn.SplitserveKVReceiver)
    recv._lifecycle_lock = threading.RLock()
    recv.conclude_state = state
    recv.kv_mgr = SimpleNamespace(connection_pool=pool, connection_lock=threading.Lock())
    recv._connection_pool_entries = entries
    return recv


def test_a_failed_load_makes_the_next_request_ask_the_bootstrap_server_again():
    """P restarted on its same HTTP and bootstrap ports binds a new side-channel port: SGLang's
    cached rank of that P (the old port) is dropped when a load fails, as SGLang's own backends
    drop it when a send fails; a load that succeeds keeps it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    infos = [{"rank_ip": "127.0.0.1", "rank_port": 5555, "is_dummy": False}]
    pool = {"127.0.0.1:8998_0_0_0": infos}
    ok = _receiver(KVPoll.Success, pool, {"127.0.0.1:8998_0_0_0": infos})
    assert ok.poll() == KVPoll.Success and pool, "a good load keeps the cache"
    failed = _receiver(KVPoll.Failed, pool, {"127.0.0.1:8998_0_0_0": infos})
    assert failed.poll() == KVPoll.Failed
    assert pool == {} and failed._connection_pool_entries == {}
    # A newer request that already fetched the new rank keeps its entry.
    fresh = [{"rank_ip": "127.0.0.1", "rank_port": 6666, "is_dummy": False}]
    pool["127.0.0.1:8998_0_0_0"] = fresh
    stale = _receiver(KVPoll.Failed, pool, {"127.0.0.1:8998_0_0_0": infos})
    assert stale.poll() == KVPoll.Failed and pool == {"127.0.0.1:8998_0_0_0": fresh}
