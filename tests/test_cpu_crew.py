"""The pooled decode kernels on jit's own threads (the calling thread + helper threads, jit.Crew; the default,
$DS4PY_CREW=0 for numba's pool) instead of numba's pool: the same bits.

Each `<name>_dec` kernel of ds4py.quant.jit_decode runs its piece loop `<name>_grab` (the pieces from one shared
counter, the row kernels) on numba's pool; the crew has the calling thread and threads - 1 helpers run it at once. Checked: every product
family a decode step makes (one matrix per format, the routed experts, the shared expert with the routed gate / up,
several matrices of one activation) gives numba's pooled kernel's bits at 2 and 3 threads (up to the cores), the twin run by
that many threads; the grab twins take the `_dec` arguments plus the counter (a changed `_dec` signature
fails here); the same bits for any split of the pieces between the caller and a helper (either taking them all,
or a helper called off before it starts); a helper that never wakes costs the caller nothing (it is called off);
the crew's threads run at once; an error in a helper reaches the caller and leaves the crew usable.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.quant import jit, jit_i8

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

F32 = np.float32


def _stored(qt, rows, cols, rng):
    from test_fused import stored

    return stored(qt, rows, cols, rng)


def _width(threads):
    """The threads a pooled call runs on: as many as asked, up to numba's thread count (this host's cores)."""
    return min(threads, jit._state["numba"].config.NUMBA_NUM_THREADS)


def _both(fn, monkeypatch):
    """fn() on numba's pool, then on the crew (every product pooled): the two results, and the kernels the crew
    ran with the threads it ran them on (the caller + helpers; a helper not started by the time the caller has
    taken the last piece is called off, so fewer may have run the twin)."""
    monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
    monkeypatch.setattr(jit, "AUTO", False)              # the crew even on a busy host
    monkeypatch.setattr(jit, "CREW", False)
    pool = fn()
    monkeypatch.setattr(jit, "CREW", True)
    seen, real = [], jit.Crew.run

    def spy(self, grab, args, k):
        ran = set()

        def grab_spy(*a):                    # which threads ran the twin (each takes pieces while any are left)
            ran.add(threading.get_ident())
            grab(*a)

        real(self, grab_spy, args, k)
        assert 1 <= len(ran) <= k + 1
        seen.append((grab.__name__, k + 1))

    monkeypatch.setattr(jit.Crew, "run", spy)
    crew = fn()
    monkeypatch.setattr(jit.Crew, "run", real)
    return pool, crew, seen


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("qt", [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K, Q.F16], ids=lambda q: q.name)
def test_one_matrix_on_the_crew_gives_the_pool_bits(qt, threads, monkeypatch):
    rng = np.random.default_rng([int(qt), threads])
    for rows, cols in ((1, 256), (37, 512), (300, 1024)):
        raw = _stored(qt, rows, cols, rng)
        x = (rng.standard_normal((2, cols)) * 3).astype(F32)
        mm = jit.matmul if qt == Q.F16 else jit_i8.matmul
        pool, crew, seen = _both(lambda: [mm(qt, raw, x[t:t + 1], threads) for t in range(2)], monkeypatch)
        for a, b in zip(pool, crew):
            np.testing.assert_array_equal(a, b, err_msg=f"{rows} x {cols}")
        if rows == 1 or (qt == Q.F16 and not jit._state["dec"].NATIVE_HALF):
            continue                         # one row: one thread, no pool; jit_kernels.f16_rows: no crew twin
        assert len(seen) == 2 and all(name.endswith("_grab") for name, _ in seen)
        assert all(n == _width(threads) for _, n in seen)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("qt", jit_i8.EXPERT_FORMATS, ids=lambda q: q.name)
def test_routed_experts_on_the_crew_give_the_pool_bits(qt, threads, monkeypatch):
    rng = np.random.default_rng([int(qt), threads, 1])
    tokens, k, n_experts, rows, cols = 1, 6, 16, 64, 512
    gate = np.stack([_stored(qt, rows, cols, rng) for _ in range(n_experts)])
    up = np.stack([_stored(qt, rows, cols, rng) for _ in range(n_experts)])
    x = (rng.standard_normal((tokens, cols)) * 2).astype(F32)
    ex = np.sort(rng.choice(n_experts, k, replace=False))
    gs, tok = np.arange(k + 1), np.zeros(k, np.int64)
    h = rng.standard_normal((k, cols)).astype(F32)

    def run():
        g, u = jit_i8.experts_matmul(qt, (gate, up), ex, gs, tok, x, threads)
        d, = jit_i8.experts_matmul(qt, (gate,), ex, gs, np.arange(k), h, threads)
        return g, u, d

    pool, crew, seen = _both(run, monkeypatch)
    for a, b in zip(pool, crew):
        np.testing.assert_array_equal(a, b)
    assert [name for name, _ in seen] == [f"{qt.name.lower()}_ex_grab"] * 2
    assert all(n == _width(threads) for _, n in seen)


def test_shared_down_with_the_routed_gate_up_and_many_matrices_give_the_pool_bits(monkeypatch):
    rng = np.random.default_rng(5)
    n_experts, rows, cols, k = 16, 64, 512, 6
    gate = np.stack([_stored(Q.IQ2_XXS, rows, cols, rng) for _ in range(n_experts)])
    up = np.stack([_stored(Q.IQ2_XXS, rows, cols, rng) for _ in range(n_experts)])
    q8 = _stored(Q.Q8_0, 200, 320, rng)
    x = rng.standard_normal((1, cols)).astype(F32)
    h = (rng.standard_normal((1, 320)) * 3).astype(F32)
    ex, gs, tok = np.sort(rng.choice(n_experts, k, replace=False)), np.arange(k + 1), np.zeros(k, np.int64)
    q8s = [_stored(Q.Q8_0, r, 512, rng) for r in (100, 7, 64)]
    h16s = [_stored(Q.F16, r, 512, rng) for r in (33, 16)]

    def run():
        out = jit_i8.experts_matmul(Q.IQ2_XXS, (gate, up), ex, gs, tok, x, 2, plain=(q8, h))
        yq, _ = jit_i8.matmul_many(q8s, [], x, 2)
        mq, mh = jit_i8.matmul_many(q8s[:2], h16s, x, 3)
        return [*out, *yq, *mq, *mh]

    pool, crew, seen = _both(run, monkeypatch)
    assert len(pool) == len(crew) == 10
    for a, b in zip(pool, crew):
        np.testing.assert_array_equal(a, b)
    assert seen == [("q8_0_iq2_xxs_ex_grab", 2), ("q8_0_many_grab", 2), ("mixed_many_grab", _width(3))]


def test_every_grab_twin_takes_its_kernels_arguments_and_a_counter():
    jit_i8._kernels()
    dec = jit._state["dec"]
    assert set(dec.GRAB) >= {"q8_0_dec", "q8_0_many_dec", "mixed_many_dec", "q8_0_ex_dec", "q8_0_iq2_xxs_ex_dec",
                             "q2_k_ex_dec", "iq2_xxs_ex_dec"}
    for name, grab in dec.GRAB.items():
        want = list(inspect.signature(getattr(dec, name).py_func).parameters)
        got = list(inspect.signature(grab.py_func).parameters)
        i, _ = dec.GRAB_PERM.get(name, (None, None))
        if i is not None:                    # the permuted codes in place of xq
            assert want[i] == "xq" and got[i] == "xp", name
            want[i] = "xp"
        assert got == want + ["ctr"], name


def test_the_crew_runs_at_once_and_an_error_in_a_helper_reaches_the_caller():
    crew = jit.Crew()
    met = threading.Barrier(3, timeout=30)               # passes only if all three run at the same time
    crew.run(met.wait, (), 2)
    ran = []

    all_in = threading.Barrier(3, timeout=30)

    def boom(who):                                       # the caller waits for both helpers, so none is called off
        ran.append(threading.get_ident())
        all_in.wait()
        if threading.get_ident() != who:
            raise RuntimeError("a helper failed")

    with pytest.raises(RuntimeError, match="a helper failed"):
        crew.run(boom, (threading.get_ident(),), 2)
    assert len(set(ran)) == 3
    again = threading.Barrier(3, timeout=30)
    crew.run(again.wait, (), 2)                          # the helpers still answer


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_makes_its_own_helpers():
    import os

    crew = jit._crew
    crew.run(lambda: None, (), 1)                        # the parent has a helper now
    pid = os.fork()
    if pid == 0:                                         # the child: its helper list starts empty, and works
        code = 1
        try:
            if crew.helpers:
                code = 2
            else:
                met = threading.Barrier(2, timeout=10)
                crew.run(met.wait, (), 1)
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("qt", [Q.Q8_0, Q.IQ2_XXS, Q.Q2_K], ids=lambda q: q.name)
def test_any_split_of_the_pieces_between_caller_and_helper_gives_the_pool_bits(qt, monkeypatch):
    """The caller starts only once the helper has taken `lead` pieces (0: at once; pieces + 1: the helper took them
    all), or the helper starts late (the caller takes them all and calls it off): numba's pooled bits each time."""
    import time

    rng = np.random.default_rng([int(qt), 7])
    real = jit.Crew.run

    def run_split(lead, helper_late):
        def spy(self, grab, args, k):
            ctr, caller = args[-1], threading.get_ident()

            def split(*a):
                if threading.get_ident() != caller:
                    time.sleep(helper_late)
                else:
                    t = time.monotonic()
                    while ctr[0] < lead and time.monotonic() - t < 10:
                        time.sleep(1e-4)
                    assert ctr[0] >= lead, "the helper never took its lead"
                grab(*a)

            real(self, split, args, k)

        monkeypatch.setattr(jit.Crew, "run", spy)
        try:
            return mm(qt, raw, x, 2)
        finally:
            monkeypatch.setattr(jit.Crew, "run", real)

    mm = jit_i8.matmul
    monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
    monkeypatch.setattr(jit, "AUTO", False)
    for rows, cols in ((5, 256), (45, 512)):
        raw = _stored(qt, rows, cols, rng)
        x = (rng.standard_normal((1, cols)) * 3).astype(F32)
        monkeypatch.setattr(jit, "CREW", False)
        want = mm(qt, raw, x, 2)
        monkeypatch.setattr(jit, "CREW", True)
        n = min(rows, 2 * jit._state["dec"].CHUNKS_PER_THREAD)           # the pieces of a 2-thread call
        for lead, late in [(0, 0.0), (0, 0.05), (n + 1, 0.0), (1, 0.0)] + [(int(rng.integers(0, n + 2)), 0.0)] * 3:
            np.testing.assert_array_equal(run_split(lead, late), want, err_msg=f"{rows} rows, lead {lead}")


def test_a_helper_that_never_wakes_is_called_off():
    """A helper asleep on its lock that a post cannot reach (as if the OS never ran it): the caller, having done
    the whole job, returns without it; the crew then still works."""
    import time

    crew = jit.Crew(spin_us=0)
    crew.run(lambda: None, (), 1)
    h = crew.helpers[0]
    t = time.monotonic()
    while not h.asleep and time.monotonic() - t < 10:
        time.sleep(1e-3)
    time.sleep(0.05)                                     # now blocked on h.go
    stuck, h.go = h.go, threading.Lock()
    h.go.acquire()
    ran = []
    caller = threading.Thread(target=crew.run, args=(lambda: ran.append(threading.get_ident()), (), 1))
    caller.start()
    caller.join(timeout=10)
    try:
        assert not caller.is_alive(), "the caller waited for a helper that never started"
        assert ran == [caller.ident]
    finally:
        h.go = stuck
        stuck.release()                                  # the helper wakes, finds no job, sleeps again
    met = threading.Barrier(2, timeout=30)
    crew.run(met.wait, (), 1)


@pytest.mark.parametrize("spin_us", [0.0, 250.0])
def test_run_returns_only_when_every_piece_is_done(spin_us):
    """A job shared out in pieces from one counter, the helper starting at random (before, during or after the
    caller's share) and each piece taking a random time: when run returns every piece is done, exactly once,
    including one the helper still had in hand when the caller ran out."""
    import time

    rng = np.random.default_rng(int(spin_us))
    crew = jit.Crew(spin_us=spin_us)
    for _ in range(12):
        n, late = int(rng.integers(1, 12)), float(rng.choice([0.0, 0.002, 0.02]))
        naps = rng.choice([0.0, 0.001, 0.01], n)
        done, lock, ctr, caller = [0] * n, threading.Lock(), [0], threading.get_ident()

        def share():
            if threading.get_ident() != caller:
                time.sleep(late)
            while True:
                with lock:
                    c, ctr[0] = ctr[0], ctr[0] + 1
                if c >= n:
                    return
                time.sleep(naps[c])
                done[c] += 1

        crew.run(share, (), 1)
        assert done == [1] * n, (n, late)


@pytest.mark.parametrize("value, want", [("40", 40.0), ("0", 0.0), ("abc", None), ("inf", None), ("-3", None)])
def test_the_spin_time_from_the_environment(value, want, monkeypatch, capsys):
    monkeypatch.setenv("DS4PY_CREW_SPIN_US", value)
    got = jit._spin_us(123.0)
    err = capsys.readouterr().err
    if want is None:                                     # one line naming the variable, and the default
        assert got == 123.0 and err.count("\n") == 1 and "DS4PY_CREW_SPIN_US" in err
    else:
        assert got == want and err == ""


def test_auto_takes_numbas_pool_while_the_host_is_busy(monkeypatch):
    """$DS4PY_CREW=auto: a pooled product runs on numba's pool while the load average is above the CPUs + margin,
    on the crew otherwise; the verdict is read again after BUSY_EVERY_S (the same bits either way: above)."""
    import os

    rng = np.random.default_rng(11)
    raw, x = _stored(Q.Q8_0, 64, 512, rng), rng.standard_normal((1, 512)).astype(F32)
    monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
    monkeypatch.setattr(jit, "CREW", True)
    monkeypatch.setattr(jit, "AUTO", True)
    runs, real = [], jit.Crew.run
    monkeypatch.setattr(jit.Crew, "run", lambda self, *a: (runs.append(1), real(self, *a)))
    got = {}
    for load in (1e6, 0.0):
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(jit, "_busy", [-1e9, False])     # read it now
        runs.clear()
        got[load] = jit_i8.matmul(Q.Q8_0, raw, x, 2)
        assert bool(runs) == (load == 0.0), load
    np.testing.assert_array_equal(got[1e6], got[0.0])
