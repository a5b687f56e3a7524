"""CPU: the decode-graph cache (ts_moe.decode_graphs) under threads, and its
environment switch read at each call.  The cache's policy runs on stand-in
graphs (no CUDA): the signature is the static arguments and a "capture" is a
cheap object, so the threads spend their time in the cache's own bookkeeping."""

import sys
import threading
import time

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


def test_replays_and_evictions_from_many_threads(monkeypatch):
    """Seven threads replay two graphs in turn (each replay moves its graph to the
    end of the LRU order) while another captures and evicts (which walks that
    order): no thread may see the order change under it.  A tiny switch
    interval lets the threads interleave between any two bytecodes; the loop
    stops at the first error (the unguarded walk failed within a second here)."""
    monkeypatch.setenv("TS_MOE_DECODE_GRAPHS", "1")
    cache = _StandIn(max_graphs=3)
    cache.IDLE_FACTOR = 1  # graphs go idle after 3 calls: an eviction every few calls
    errors, stop = [], threading.Event()
    deadline = time.monotonic() + 4.0

    def hammer(keys):
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                assert cache.call(_first, 1, (i,), (), keys(i)) == i
            except Exception as exc:  # noqa: BLE001 (reported by the test)
                errors.append(f"{type(exc).__name__}: {exc}")
                stop.set()
            i += 1

    def hot(i):
        return i % 2          # graphs 0 and 1, each replay reorders them

    def cold(i):
        return 2 + i // 2 % 3  # graphs 2, 3, 4: captured at the second call, then evicted

    threads = [threading.Thread(target=hammer, args=(cold,))]
    threads += [threading.Thread(target=hammer, args=(hot,)) for _ in range(7)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    evictions = len(cache.captured) - len(cache)
    assert evictions > 50, f"the threads did exercise eviction ({evictions})"
    assert len(cache) <= cache.max_graphs and {(0,), (1,)} <= set(cache._graphs)


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
