"""The SGLang adapter of the adaptive chunk budget: switch parsing, the adder cap, the state read
from a scheduler, batch features, settings errors. Fakes stand in for SGLang's scheduler objects
(named Fake*); the hook wiring on a real SGLang server is in
tests/integration/test_sglang_server.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from splitserve.schedulers import sglang as adapter
from splitserve.schedulers.policy import SchedulerSettingsError


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_switch_on(value):
    assert adapter.adaptive_budget_requested({adapter.ENABLE_ENV: value}) is True


@pytest.mark.parametrize("value", ["", "0", "false", "Off", "no"])
def test_switch_off(value):
    assert adapter.adaptive_budget_requested({adapter.ENABLE_ENV: value}) is False
    assert adapter.adaptive_budget_requested({}) is False


def test_switch_invalid_value_names_the_variable():
    with pytest.raises(SchedulerSettingsError, match="SPLITSERVE_ADAPTIVE_BUDGET"):
        adapter.adaptive_budget_requested({adapter.ENABLE_ENV: "maybe"})


def test_hooks_wanted_whenever_the_switch_is_set():
    assert not adapter.hooks_wanted({})
    assert adapter.hooks_wanted({adapter.ENABLE_ENV: "0"})
    assert adapter.hooks_wanted({adapter.ENABLE_ENV: "bogus"})


class FakePrefillAdder:
    def __init__(self, page_size, rem_chunk_tokens, num_mixed_decode_tokens=0):
        self.rem_chunk_tokens = rem_chunk_tokens
        if rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= num_mixed_decode_tokens


def test_adder_caps_rem_chunk_tokens_never_raises_it():
    cls = adapter.make_adder_class(FakePrefillAdder)
    assert issubclass(cls, FakePrefillAdder)
    cls.splitserve_budget = 256
    assert cls(1, 4096).rem_chunk_tokens == 256
    assert cls(1, None).rem_chunk_tokens == 256  # chunking off: the budget still applies
    assert cls(1, 100).rem_chunk_tokens == 100  # never above SGLang's own choice
    assert cls(1, 4096, num_mixed_decode_tokens=10).rem_chunk_tokens == 256
    cls.splitserve_budget = None
    assert cls(1, 4096).rem_chunk_tokens == 4096


@dataclass
class FakeReq:
    seqlen: int
    prefix_len: int = 0
    done: bool = False

    def finished(self):
        return self.done


@dataclass
class FakeBatch:
    reqs: list


@dataclass
class FakeScheduler:
    running: list
    waiting: list
    chunked: FakeReq | None = None
    page_size: int = 1
    chunked_prefill_size: int | None = 512
    max_prefill_tokens: int = 16384
    is_mixed_chunk: bool = False

    @property
    def running_batch(self):
        return FakeBatch(self.running)

    @property
    def waiting_queue(self):
        return self.waiting

    @property
    def chunked_req(self):
        return self.chunked


def test_step_state_reads_decodes_chunked_then_waiting():
    sched = FakeScheduler(
        running=[FakeReq(100), FakeReq(50, done=True), FakeReq(7)],
        waiting=[FakeReq(30), FakeReq(10, prefix_len=10)],
        chunked=FakeReq(1000, prefix_len=256),
    )
    state = adapter.step_state(sched)
    assert list(state.decode_context_lens) == [100, 7]
    assert [(p.remaining_tokens, p.computed_tokens) for p in state.prefills] == [
        (744, 256),
        (30, 0),
    ]


class FakeMode:
    def __init__(self, kind):
        self.kind = kind

    def is_extend(self):
        return self.kind == "extend"

    def is_decode(self):
        return self.kind == "decode"


@dataclass
class FakeScheduleBatch:
    kind: str
    reqs: list
    prefix_lens: list | None = None
    extend_lens: list | None = None
    seq_lens_sum: int | None = None

    @property
    def forward_mode(self):
        return FakeMode(self.kind)


def test_batch_features_extend_and_decode():
    extend = FakeScheduleBatch("extend", [1, 2], prefix_lens=[0, 100], extend_lens=[10, 20])
    f = adapter.batch_features(extend)
    assert (f.tokens, f.sequences) == (30, 2)
    assert f.attention_pairs == 10 * 11 // 2 + (20 * 100 + 20 * 21 // 2)
    decode = FakeScheduleBatch("decode", [1, 2, 3], seq_lens_sum=300)
    f = adapter.batch_features(decode)
    assert (f.tokens, f.sequences, f.attention_pairs) == (3, 3, 300)
    assert adapter.batch_features(FakeScheduleBatch("idle", [])) is None


def test_build_budget_off_returns_none():
    assert adapter.build_budget(FakeScheduler([], []), {}) is None


def test_build_budget_bad_setting_names_the_field(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("target_itl_ms: -3\n")
    env = {adapter.ENABLE_ENV: "1", "SPLITSERVE_SCHEDULER_CONFIG": str(cfg)}
    with pytest.raises(SchedulerSettingsError, match="target_itl_ms"):
        adapter.build_budget(FakeScheduler([], []), env)


def test_build_budget_max_chunk_above_chunked_prefill_size(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("max_chunk: 1024\n")
    env = {adapter.ENABLE_ENV: "1", "SPLITSERVE_SCHEDULER_CONFIG": str(cfg)}
    with pytest.raises(SchedulerSettingsError, match="max_chunk"):
        adapter.build_budget(FakeScheduler([], [], chunked_prefill_size=512), env)


def test_hooks_apply_the_policy_budget(tmp_path):
    pytest.importorskip("sglang.srt.managers.schedule_policy")  # the adder subclasses SGLang's
    cfg = tmp_path / "s.yaml"
    cfg.write_text("target_itl_ms: 30\nmin_chunk: 16\nalignment: 16\n")
    env = {adapter.ENABLE_ENV: "1", "SPLITSERVE_SCHEDULER_CONFIG": str(cfg)}
    sched = FakeScheduler(running=[], waiting=[FakeReq(2000)], chunked_prefill_size=512)
    sched_budget = adapter.build_budget(sched, env)
    object.__setattr__(sched, adapter._STATE_ATTR, sched_budget)  # noqa: SLF001
    from sglang.srt.managers.schedule_policy import PrefillAdder

    cls = adapter.around_get_prefill_adder_class(lambda s: PrefillAdder, sched)
    assert issubclass(cls, PrefillAdder)
    assert cls.splitserve_budget == 512  # nothing decodes: the maximum chunk
    sched.running = [FakeReq(1000) for _ in range(32)]
    adapter.around_get_prefill_adder_class(lambda s: PrefillAdder, sched)
    assert 16 <= sched_budget.last_budget < 512  # the default step model: 30 ms fits less
    assert sched_budget.last_budget % 16 == 0
