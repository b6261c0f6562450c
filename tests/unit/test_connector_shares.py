"""The worker's share records (``connectors/vllm/shares.py``), pure: one record per request and
side, settled once its last share settled, a reused id refused on either side."""

from __future__ import annotations

from splitserve.connectors.vllm.ranks import Ranks
from splitserve.connectors.vllm.shares import Shares


def test_equal_sizes_one_share_under_the_transfer_id():
    shares = Shares(Ranks(size=2, rank=1, total_kv_heads=4))
    assert shares.start_sending("t", None) == ["t"]
    assert shares.sources("t", 2) == [(1, "t")]
    assert shares.released("t", "t") and shares.is_idle()


def test_p_reports_the_request_free_after_its_last_share_only():
    shares = Shares(Ranks(size=1, rank=0, total_kv_heads=4), decode_tp=2)
    assert shares.start_sending("t", None) == ["t@d0", "t@d1"]
    assert shares.start_sending("t", None) is None  # in use: refused, the record untouched
    assert shares.sending("t", decode_tp=4) == ["t@d0", "t@d1"]  # fixed at the start
    assert not shares.released("t", "t@d1")
    assert shares.released("t", "t@d0") and shares.is_idle()


def test_a_load_fails_as_a_whole_and_aborts_the_shares_still_loading():
    shares = Shares(Ranks(size=1, rank=0, total_kv_heads=4))
    sources = shares.sources("t", 2)
    assert sources == [(0, "t@p0"), (1, "t@p1")]
    assert shares.start_loading("t", [s for _, s in sources])
    assert not shares.start_loading("t", ["t@p0"])  # already awaited
    aborted: list[str] = []
    assert shares.settle("t", "t@p0", False, None, "P gone", lambda s, r: aborted.append(s)) is None
    assert aborted == ["t@p1"]
    ok, token, reason = shares.settle("t", "t@p1", False, None, "aborted", aborted.append)
    assert not ok and token is None and "t@p0" in reason and "P gone" in reason
    assert aborted == ["t@p1"] and shares.is_idle()


def test_a_load_completes_with_p_s_first_token_once_every_share_arrived():
    shares = Shares(Ranks(size=1, rank=0, total_kv_heads=4))
    shares.start_loading("t", ["t@p0", "t@p1"])
    assert shares.settle("t", "t@p1", True, 42, "", lambda *_: None) is None
    assert shares.settle("t", "t@p0", True, None, "", lambda *_: None) == (True, 42, "")
    # an unrecorded transfer settles as itself
    assert shares.settle("u", "u", False, None, "why", lambda *_: None) == (False, None, "why")
