"""The ``splitserve`` SGLang transfer backend without servers: the plugin makes the backend name
parse with SGLang's real argument parser and resolve to our classes; SGLang's buffers become a
``KVLayout`` (KV buffers, then aux rows); model layers map to their K and V buffers; settings
are read from the environment with errors that name the variable."""

from __future__ import annotations

import pytest

from splitserve.connectors.sglang.transport import (
    BackendSettings,
    BackendSettingsError,
    layout_from_buffers,
    layout_layers_of_model_layers,
)


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
