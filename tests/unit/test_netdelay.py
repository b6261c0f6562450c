"""The NFQUEUE delayer's own logic (splitserve.launch.netdelay): the delay samples, the release
order of held packets, and its arguments. No queue, no namespace: the integration test
(tests/integration/test_testbed.py) runs it on real packets."""

from __future__ import annotations

import statistics

import pytest

from splitserve.launch import netdelay
from splitserve.launch.netdelay import Delayer, DelaySchedule, parse_args


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """A schedule answering given delays in turn."""

    def __init__(self, *delays: float) -> None:
        self.delays = list(delays)

    def sample(self) -> float:
        return self.delays.pop(0)


class FakePacket:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def accept(self) -> None:
        self.log.append(self.name)


def test_without_jitter_every_packet_gets_the_delay():
    schedule = DelaySchedule(0.005)
    assert {schedule.sample() for _ in range(100)} == {0.005}


def test_jitter_is_normal_around_the_delay_and_seeded():
    schedule = DelaySchedule(0.010, 0.002, seed=7)
    many = [schedule.sample() for _ in range(20000)]
    again = DelaySchedule(0.010, 0.002, seed=7)
    assert [again.sample() for _ in range(5)] == many[:5]
    assert abs(statistics.fmean(many) - 0.010) < 0.0001  # standard error 14 us
    assert abs(statistics.stdev(many) - 0.002) < 0.0001
    # Normal: about 68 % within one standard deviation, 95 % within two.
    within = sum(abs(x - 0.010) < 0.002 for x in many) / len(many)
    assert 0.66 < within < 0.70
    assert 0.94 < sum(abs(x - 0.010) < 0.004 for x in many) / len(many) < 0.96
    other = DelaySchedule(0.010, 0.002, seed=8)
    assert [other.sample() for _ in range(5)] != many[:5]


def test_jitter_larger_than_the_delay_is_clipped_at_zero():
    schedule = DelaySchedule(0.001, 0.005, seed=1)
    many = [schedule.sample() for _ in range(20000)]
    assert min(many) == 0.0
    # P(N(1, 5) < 0) = P(Z < -0.2) = 0.42: those are sent at once, none earlier.
    assert 0.40 < many.count(0.0) / len(many) < 0.44


def test_negative_delay_or_jitter_is_refused():
    with pytest.raises(ValueError):
        DelaySchedule(-0.001)
    with pytest.raises(ValueError):
        DelaySchedule(0.001, -0.001)


def test_packets_are_accepted_at_their_release_time_in_release_order():
    clock, log = FakeClock(), []
    delayer = Delayer(Scripted(0.010, 0.002, 0.006), clock=clock)  # type: ignore[arg-type]
    assert delayer.timeout() is None
    for name in "abc":
        delayer.hold(FakePacket(name, log))
    assert log == [] and len(delayer) == 3
    assert delayer.timeout() == pytest.approx(0.002)
    clock.now += 0.0019
    assert delayer.release_due() == 0
    clock.now += 0.0001
    assert delayer.release_due() == 1 and log == ["b"]  # b overtook a
    assert delayer.timeout() == pytest.approx(0.004)
    clock.now += 0.005
    assert delayer.release_due() == 1 and log == ["b", "c"]
    clock.now += 0.010
    assert delayer.timeout() == 0.0  # overdue
    assert delayer.release_due() == 1 and log == ["b", "c", "a"]
    assert len(delayer) == 0 and delayer.timeout() is None
    assert delayer.held_total == 3


def test_equal_release_times_keep_arrival_order_and_the_callback_releases_what_is_due():
    clock, log = FakeClock(), []
    delayer = Delayer(Scripted(0.005, 0.005, 0.005, 0.0), clock=clock)  # type: ignore[arg-type]
    delayer.hold(FakePacket("a", log))
    delayer.hold(FakePacket("b", log))
    clock.now += 0.005
    # A flood keeps the queue's read loop busy: the next arrival releases what is due.
    delayer.hold(FakePacket("c", log))
    assert log == ["a", "b"]
    delayer.hold(FakePacket("d", log))  # no delay: out at once
    assert log == ["a", "b", "d"]


def test_flush_accepts_everything_held_in_release_order():
    clock, log = FakeClock(), []
    delayer = Delayer(Scripted(0.3, 0.1, 0.2), clock=clock)  # type: ignore[arg-type]
    for name in "abc":
        delayer.hold(FakePacket(name, log))
    assert delayer.flush() == 3
    assert log == ["b", "c", "a"] and len(delayer) == 0


def test_arguments():
    options = parse_args(["--delay-ms", "5"])
    assert options == netdelay.Options(
        queue=0, delay_ms=5.0, jitter_ms=0.0, seed=None, owner_pid=None, max_held=16384
    )
    argv = ["--queue", "3", "--delay-ms", "5", "--jitter-ms", "2.5", "--seed", "9"]
    options = parse_args([*argv, "--owner-pid", "42", "--max-held", "10"])
    assert (options.queue, options.jitter_ms, options.seed, options.owner_pid) == (3, 2.5, 9, 42)
    assert options.max_held == 10


@pytest.mark.parametrize(
    "argv",
    [
        [],  # the delay is required
        ["--delay-ms", "-1"],
        ["--delay-ms", "5", "--jitter-ms", "-1"],
        ["--delay-ms", "5", "--queue", "65536"],
        ["--delay-ms", "5", "--queue", "-1"],
        ["--delay-ms", "5", "--max-held", "0"],
        ["--delay-ms", "5", "--owner-pid", "0"],
        ["--delay-ms", "five"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
