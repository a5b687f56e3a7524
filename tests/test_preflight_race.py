"""CPU: ``raced-uniform`` (``csrc_free_kernels/preflight/race.py``): a value loaded from
a shared word that a thread writes in the same barrier phase is not uniform, so a
barrier it guards fails, on the barrier; the same load after a ``bar.sync`` that orders
the write passes.  Planted in the PTX of a shipped build: ``gemm_decode16``, whose
prologue writes its per-expert tile table to shared memory (one thread writes the last
entry) and then takes ``bar.sync 0``.  Source: the PTX ISA's memory consistency model
(data races) and bar.sync."""

import re

from csrc_free_kernels import preflight

from .test_preflight import _rules, builds  # noqa: F401 (the session's builds)

GEMM = "gemm_decode16"
BAR = "\tbar.sync \t0;\n"


def _line_of(text: str, pattern: str, after: int = 0) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1)
                if n > after and re.search(pattern, line))


def _plant(text: str, ordered: bool = False, write_after: bool = False) -> tuple:
    """``text`` with a branch around its first ``bar.sync 0`` on the word the last
    ``st.shared.b32`` before it writes, loaded just before the barrier (``ordered``:
    after a ``bar.sync 0`` of its own; ``write_after``: and that thread writes the word
    again after the load), and the store's guard: ``(planted, store)``."""
    at = text.index(BAR)
    store = list(re.finditer(r"\tst\.shared\.b32 \t(\[%r\d+\+\d+\]), (%r\d+);\n", text[:at]))[-1]
    guard = re.findall(r"@(%p\d+) bra", text[store.start() - 2000:store.start()])[-1]
    word, value = store.group(1), store.group(2)
    branch = (BAR if ordered else "") + (
        f"\tld.shared.b32 \t%r9001, {word};\n"
        f"\tsetp.lt.s32 \t%p9001, %r9001, 1;\n")
    if write_after:
        branch += f"\t@!{guard} st.shared.b32 \t{word}, {value};\n"
    branch += "\t@%p9001 bra \t$L__RACE;\n"
    planted = text[:at] + branch + BAR + "$L__RACE:\n" + text[at + len(BAR):]
    return planted, store


def test_a_barrier_guarded_by_a_word_written_in_its_phase_fails(builds):
    text, facts = builds[GEMM]
    assert preflight.check(GEMM, text, facts) == []
    planted, store = _plant(text)
    found = preflight.check(GEMM, planted, facts)
    assert _rules(found) == ["raced-uniform"] and len(found) == 1, found
    load = _line_of(planted, r"ld\.shared\.b32 \t%r9001,")
    assert found[0].line == _line_of(planted, r"^\s*bar\.sync \t0;", after=load)
    wrote = re.search(rf"the value loaded at PTX line {load}, which the write at PTX line "
                      rf"(\d+)", found[0].why)
    assert wrote, found[0].why  # a store of the table's word, before any barrier
    offset = store.group(1).split("+")[1]
    assert re.search(rf"st\.shared\.b32 \t\[%r\d+\+{offset}", planted.splitlines()[
        int(wrote.group(1)) - 1]) and int(wrote.group(1)) < load


def test_the_same_load_after_a_barrier_that_orders_the_write_passes(builds):
    text, facts = builds[GEMM]
    assert preflight.check(GEMM, _plant(text, ordered=True)[0], facts) == []


def test_a_write_after_the_load_in_its_phase_fails(builds):
    """The barrier orders the first write; the thread's second, after its own load, may
    land before another thread's load."""
    text, facts = builds[GEMM]
    planted, _ = _plant(text, ordered=True, write_after=True)
    found = preflight.check(GEMM, planted, facts)
    assert _rules(found) == ["raced-uniform"] and len(found) == 1, found
    again = _line_of(planted, r"@!%p\d+ st\.shared\.b32")
    assert f"which the write at PTX line {again}" in found[0].why, found[0].why


def test_loads_of_the_table_after_its_barrier_stay_uniform(builds):
    """The shipped build's table loads (after ``bar.sync 0``) are judged and not raced,
    though the prologue's stores write the same words."""
    text, facts = builds[GEMM]
    pf = preflight.context.Preflight(GEMM, text, facts)
    pf.flow
    judged = [pf.k.instrs[i] for i in pf.races.found if pf.k.instrs[i].op.startswith("ld.shared")]
    assert judged and all(pf.races.found[i.index] is None for i in judged)
