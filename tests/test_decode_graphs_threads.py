"""CPU: the decode-graph cache (ts_moe.decode_graphs) under threads, and its
environment switch read at each call.  The cache's policy runs on stand-in
graphs (no CUDA): the signature is the static arguments and a "capture" is a
cheap object, so the threads spend their time in the cache's own bookkeeping."""

import sys
import threading

import pytest

from ts_moe import decode_graphs


class _Replay:
    __slots__ = ("last_use",)

    def __init__(self):
        self.last_use = 0

    def replay(self, dynamic):
        return dynamic[0]


class _StandIn(decode_graphs.DecodeGraphs):
    """The cache with every call graphable and a capture that costs nothing."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.captured = []

    def _signature(self, fn, num_experts, dynamic, fixed, static):
        return static

    def _capture(self, key, fn, dynamic, fixed, static):
        self.captured.append(key)
        return _Replay()


def _first(x, _static):
    return x


COLD_CALLS = 50_000  # the capturing thread's calls at least: an eviction per four at least
HOT_CALLS = 10_000  # each replaying thread's calls at least, made while the capturing one runs
HANG = 600.0  # seconds: a deadlock, not a slow machine


@pytest.mark.parametrize("schedule", ["free", "replays starved at the end"])
def test_replays_and_evictions_from_many_threads(monkeypatch, schedule):
    """Seven threads replay two graphs in turn (each replay moves its graph to the
    end of the LRU order) while another captures and evicts (which walks that
    order): no thread may see the order change under it.  A tiny switch
    interval lets the threads interleave between any two bytecodes; the loop
    stops at the first error (the unguarded walk failed within a second here).

    Bounded by work, not time: the capturing thread runs until it has made
    ``COLD_CALLS`` calls and each replaying thread ``HOT_CALLS``, so a busy
    machine makes the test slower, never different; its four graphs do not fit
    in the cache even alone, so it evicts under any schedule.  The assertions
    are what the policy guarantees under any schedule, not what a quiet machine
    usually gives: the graphs held never exceed ``max_graphs``, each was
    captured, and once alone the two graphs in use get their places back and
    keep them.  A starved replaying thread lets its graph go idle, and evicting
    it then is right: the second schedule, the one a busy CI machine gave, stops
    the replaying threads first."""
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "1")
    cache = _StandIn(max_graphs=3)
    cache.IDLE_FACTOR = 1  # graphs go idle after 3 calls: an eviction every few calls
    errors, cold_done, hot_calls = [], threading.Event(), [0] * 7

    def hammer(keys, more, count=None):
        i = 0
        while not errors and more(i):
            try:
                assert cache.call(_first, 1, (i,), (), keys(i)) == i
            except Exception as exc:  # noqa: BLE001 (reported by the test)
                errors.append(f"{type(exc).__name__}: {exc}")
            i += 1
            if count is not None:
                hot_calls[count] = i

    def hot(i):
        return i % 2          # graphs 0 and 1, each replay reorders them

    def cold(i):
        return 2 + i // 2 % 4  # graphs 2 to 5: captured at the second call, then evicted

    starved = schedule != "free"

    def cold_thread():
        try:
            hammer(cold, lambda i: i < COLD_CALLS or min(hot_calls) < HOT_CALLS)
            if starved:  # the replaying threads are done: their graphs go idle
                hammer(cold, lambda i: i < 100)
        finally:
            cold_done.set()

    def hot_more(i):
        return not cold_done.is_set() and not (starved and i >= HOT_CALLS)

    threads = [threading.Thread(target=cold_thread)]
    threads += [threading.Thread(target=hammer, args=(hot, hot_more, n)) for n in range(7)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors[:3]
    assert cache.captures == len(cache.captured)
    evictions = len(cache.captured) - len(cache)
    assert evictions > 50, f"the threads did exercise eviction ({evictions})"
    assert len(cache) <= cache.max_graphs and set(cache._graphs) <= set(cache.captured)
    if starved:
        assert not {(0,), (1,)} & set(cache._graphs)  # idle, so evicted: as they should be

    # alone again: a graph in use is captured again within a few calls once the
    # others are idle, and then stays (replays only, no capture)
    for i in range(4 * cache.IDLE_FACTOR * cache.max_graphs):
        assert cache.call(_first, 1, (i,), (), hot(i)) == i
    assert {(0,), (1,)} <= set(cache._graphs)
    captured = len(cache.captured)
    for i in range(100):
        assert cache.call(_first, 1, (i,), (), hot(i)) == i
    assert len(cache.captured) == captured and {(0,), (1,)} <= set(cache._graphs)


def test_the_environment_switch_is_read_at_each_call(monkeypatch):
    monkeypatch.delenv("TS_MOE_DECODE_GRAPHS", raising=False)
    monkeypatch.setattr(decode_graphs.graphs, "_switch", None)  # as imported: no choice made
    cache = _StandIn()
    assert cache.enabled
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "0")  # after the cache was made
    assert not cache.enabled and not decode_graphs.graphs.enabled
    for _ in range(3):
        assert cache.call(_first, 1, (5,), (), 7) == 5
    assert cache.captured == [] and not cache._seen  # eager: not even counted
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "1")
    for _ in range(3):
        assert cache.call(_first, 1, (5,), (), 7) == 5
    assert cache.captured == [(7,)]
    cache.disable()  # an explicit choice outlasts the environment
    assert not cache.enabled
    cache.enable()
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "0")
    assert cache.enabled
