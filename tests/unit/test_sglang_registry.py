"""Registering an out-of-tree transfer backend with a stock SGLang, in-process: the enum member,
the CLI choice (SGLang's real argument parser) and the class lookup through SGLang's real
``HookRegistry``. The classes registered here are SGLang's own ``fake`` backend's, under a test
name: what is tested is our registration mechanism, not a backend."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.disaggregation.utils")

from sglang.srt.disaggregation import utils as disagg_utils  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from splitserve.connectors.sglang import registry  # noqa: E402

NAME = "splitserve_test_backend"


def _fake_classes() -> dict[str, type]:
    from sglang.srt.disaggregation.fake import FakeKVManager, FakeKVReceiver, FakeKVSender

    return {"MANAGER": FakeKVManager, "SENDER": FakeKVSender, "RECEIVER": FakeKVReceiver}


@pytest.fixture(scope="module")
def registered():
    registry.register_transfer_backend(NAME, _fake_classes)
    registry.register_transfer_backend(NAME, _fake_classes)  # idempotent
    HookRegistry.apply_hooks()
    return disagg_utils.TransferBackend(NAME)


def test_enum_member(registered):
    assert registered.value == NAME
    assert registered is disagg_utils.TransferBackend[NAME.upper()]
    assert registered in list(disagg_utils.TransferBackend)
    assert disagg_utils.TransferBackend("nixl").name == "NIXL"  # SGLang's own untouched


def test_cli_choice_parses(registered):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()  # what sglang.launch_server builds
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", NAME])
    assert args.disaggregation_transfer_backend == NAME
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "nope"])


def test_class_lookup(registered):
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.fake import FakeKVSender

    get = disagg_utils.get_kv_class
    assert get(registered, disagg_utils.KVClassType.SENDER) is FakeKVSender
    assert get(registered, disagg_utils.KVClassType.KVARGS) is KVArgs
    assert get(registered, disagg_utils.KVClassType.BOOTSTRAP_SERVER) is None
    nixl_sender = get(disagg_utils.TransferBackend.NIXL, disagg_utils.KVClassType.SENDER)
    assert nixl_sender.__name__ == "NixlKVSender"
