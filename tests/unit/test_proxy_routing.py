"""Routing policies and health bookkeeping (splitserve.proxy.routing, splitserve.proxy.health)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from splitserve.proxy.config import HealthSettings
from splitserve.proxy.errors import NoHealthyServer
from splitserve.proxy.health import HealthTracker
from splitserve.proxy.metrics import ProxyMetrics
from splitserve.proxy.routing import Backend, HashRing, Pool, PowerOfTwo, prompt_head


def backends(n: int, pool: str = "prefill") -> list[Backend]:
    return [Backend(pool, f"http://s{i}:1") for i in range(n)]


def test_round_robin_cycles_over_healthy() -> None:
    bs = backends(3)
    pool = Pool("prefill", bs, "round_robin")
    assert [pool.pick().url for _ in range(6)] == [b.url for b in bs] * 2
    bs[1].healthy = False
    assert {pool.pick().url for _ in range(4)} == {bs[0].url, bs[2].url}


def test_least_outstanding_prefers_idle_and_spreads_ties() -> None:
    bs = backends(3)
    pool = Pool("decode", bs, "least_outstanding")
    bs[0].outstanding, bs[1].outstanding, bs[2].outstanding = 5, 1, 3
    assert pool.pick() is bs[1]
    for b in bs:
        b.outstanding = 0
    assert Counter(pool.pick().url for _ in range(30)) == {b.url: 10 for b in bs}


def test_power_of_two_never_picks_the_busiest_of_three() -> None:
    bs = backends(3)
    bs[0].outstanding, bs[1].outstanding, bs[2].outstanding = 9, 0, 1
    policy = PowerOfTwo(random.Random(0))
    picks = Counter(policy.choose(bs).url for _ in range(300))
    assert picks[bs[0].url] == 0
    assert picks[bs[1].url] > picks[bs[2].url] > 0


def test_exclude_and_no_healthy() -> None:
    bs = backends(2)
    pool = Pool("prefill", bs, "round_robin")
    assert pool.pick(exclude=[bs[0]]) is bs[1]
    with pytest.raises(NoHealthyServer, match="2 already failed"):
        pool.pick(exclude=[*bs, Backend("decode", "http://other:1")])
    for b in bs:
        b.healthy = False
    with pytest.raises(NoHealthyServer, match="no healthy prefill server"):
        pool.pick()


def test_prefix_affinity_is_sticky_and_consistent() -> None:
    bs = backends(4)
    pool = Pool("prefill", bs, "round_robin", prefix_affinity=True)
    keys = [f"system prompt {i}" for i in range(200)]
    first = {k: pool.pick(k) for k in keys}
    assert all(pool.pick(k) is first[k] for k in keys), "same head, same server"
    assert len(set(first.values())) == 4, "keys spread over every server"
    bs[2].healthy = False
    moved = {k for k in keys if pool.pick(k) is not first[k]}
    assert moved == {k for k in keys if first[k] is bs[2]}, "only the ejected server's keys move"
    assert pool.pick(None) is not bs[2]


def test_hash_ring_walk_visits_each_backend_once() -> None:
    bs = backends(3)
    assert sorted(b.url for b in HashRing(bs).walk("x")) == sorted(b.url for b in bs)


def test_prompt_head() -> None:
    assert prompt_head({"prompt": "abcdef"}, 3) == "abc"
    assert prompt_head({"prompt": [1, 2, 3]}, 100) == "[1, 2, 3]"
    chat = {
        "messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}]
    }
    assert prompt_head(chat, 100) == "be nice\nhi"
    assert prompt_head(chat, 4) == "be n"
    assert prompt_head({}, 10) is None


def test_health_ejects_after_threshold_and_readmits() -> None:
    b = Backend("decode", "http://d:1")
    metrics = ProxyMetrics()
    tracker = HealthTracker(
        [b], HealthSettings(failures_to_eject=2, successes_to_readmit=2), metrics
    )
    tracker.observe(b, False, "down")
    assert b.healthy
    tracker.observe(b, False, "down")
    assert not b.healthy and b.ejections == 1
    tracker.observe(b, True)
    assert not b.healthy
    tracker.observe(b, True)
    assert b.healthy
    tracker.observe(b, False, "refused", decisive=True)
    assert not b.healthy and b.ejections == 2
    text = metrics.render().decode()
    assert (
        'splitserve_proxy_ejections_total{pool="decode",reason="health_check",'
        'server="http://d:1"} 2.0' in text
    )
    assert 'splitserve_proxy_server_healthy{pool="decode",server="http://d:1"} 0.0' in text


def test_connect_failure_ejects_at_once_unless_disabled() -> None:
    b = Backend("prefill", "http://p:1")
    HealthTracker([b], HealthSettings(), ProxyMetrics()).connect_failed(b, "refused")
    assert not b.healthy
    c = Backend("prefill", "http://p:2")
    HealthTracker([c], HealthSettings(eject_on_connect_error=False), ProxyMetrics()).connect_failed(
        c, "x"
    )
    assert c.healthy
