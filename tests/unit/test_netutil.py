"""Unit tests of ``splitserve.netutil``'s port pickers (our own logic, on real sockets)."""

from __future__ import annotations

import socket

from splitserve import netutil


def _ephemeral() -> range:
    low, high = netutil._ephemeral_range()
    return range(low, high + 1)


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ports = netutil.free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        assert port not in _ephemeral()
        assert port not in netutil._SGLANG_SPAN  # where SGLang picks its own later-bound port
        assert netutil._LOW_PORT <= port < netutil._HIGHEST_BASE  # a valid base in settings
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_skip_a_port_someone_listens_on() -> None:
    taken = []
    try:
        for port in netutil.free_ports(20):
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        for _ in range(20):
            assert not held & set(netutil.free_ports(5))
    finally:
        for s in taken:
            s.close()


def test_free_port_run_is_consecutive_and_outside_the_ephemeral_range() -> None:
    base = netutil.free_port_run(4)
    for port in range(base, base + 4):
        assert port not in _ephemeral()
        assert port not in netutil._SGLANG_SPAN
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert netutil.free_port_run(1) not in _ephemeral()


def test_candidates_fall_back_when_the_ephemeral_range_starts_low(monkeypatch) -> None:
    """A kernel whose ephemeral range starts below SGLang's span still leaves ports below it;
    one that starts at our lowest port leaves only ports above it."""
    monkeypatch.setattr(netutil, "_ephemeral_range", lambda: (15000, 60999))
    assert netutil._candidate_ports() == range(netutil._LOW_PORT, 15000)
    monkeypatch.setattr(netutil, "_ephemeral_range", lambda: (10000, 40000))
    assert netutil._candidate_ports() == range(40001, netutil._HIGHEST_BASE)
