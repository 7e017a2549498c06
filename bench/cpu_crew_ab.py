"""The pooled decode kernels' threads, A/B in one process: the previous crew against the current one, round by round.

    python bench/cpu_crew_ab.py -m MODEL.gguf [--threads 2] [--gen 8] [--rounds 6] [--busy 0,2] [--pool]
                                [--spin-us 250,50] [--auto] [--json OUT.json]

Arms (ds4py.quant.jit.Crew, switched between rounds in one process, the file and the compiled kernels shared):
- wait: the previous crew ($DS4PY_CREW=wait): a helper sleeps on a lock between calls, the caller waits for it
  to finish each call, even when it took no piece;
- spin: the current one (the default): a helper not started by the time the caller has taken the last piece is
  called off, and both threads spin (GIL-free, $DS4PY_CREW_SPIN_US) before they sleep; --spin-us U,V,...: one
  arm `spinU` per spin time instead;
- pool (--pool): numba's workqueue pool ($DS4PY_CREW=0);
- auto (--auto): the default ($DS4PY_CREW=auto): numba's pool while the host is busy (jit.host_busy), else spin.
The file is read once first (page cache warm), then for each --busy count B (default 0 and 2) B busy processes
(a Python spin loop each, started and ended here, each in its own session: with autogroup scheduling, as another
user's load and not a share of this process's group) run beside --rounds rounds; each round runs every arm, the
order rotating round by round, each arm a fresh state: one prompt token, then --gen timed greedy decode steps.
Per arm: ms / token min and median over the rounds, CPU ms / token (this process's user + system time over the
decode steps, all threads), the per-round ratio to `wait` (median), and the 1-minute load average around it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import os
import statistics
import sys
import time

from cpu_harness import REPO  # noqa: F401  (sys.path: this checkout first; OPENBLAS_NUM_THREADS=1)

ARMS = {"wait": {"crew": True, "spin_us": 0.0, "revoke": False},
        "spin": {"crew": True, "spin_us": None, "revoke": True},
        "pool": {"crew": False, "spin_us": 0.0, "revoke": False},
        "auto": {"crew": True, "spin_us": None, "revoke": True, "auto": True}}


BUSY = "x = 0\nwhile True:\n    x += 1\n"          # another process's load: one core's worth of pure Python


def set_arm(jit, name: str) -> None:
    arm = ARMS[name]
    jit.AUTO = arm.get("auto", False)
    jit.CREW = arm["crew"]
    jit._crew.spin_us = jit.SPIN_US if arm["spin_us"] is None else arm["spin_us"]
    jit._crew.revoke = arm["revoke"]


def decode_round(m, gen: int) -> tuple[float, float]:
    """(wall s, CPU s) of `gen` greedy decode steps after a one-token prompt on a fresh state."""
    import numpy as np

    st = m.new_state()
    lg = m.prefill(st, [5])
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(gen):
        lg = m.decode(st, int(np.argmax(lg)))
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=8, help="decode steps a round and arm")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--busy", default="0,2", help="comma-separated counts of busy processes to run beside")
    ap.add_argument("--pool", action="store_true", help="numba's pool as a third arm")
    ap.add_argument("--auto", action="store_true", help="the default ($DS4PY_CREW=auto: the pool while busy) too")
    ap.add_argument("--spin-us", default="", help="comma-separated spin times, one arm each (default: $DS4PY_CREW_SPIN_US)")
    ap.add_argument("--no-warm", action="store_true", help="skip reading the file once first")
    ap.add_argument("--json", help="write the rounds and the summary here")
    a = ap.parse_args()
    if not os.path.isfile(a.model):
        sys.exit(f"cpu_crew_ab: no model file at {a.model}")
    try:
        counts = [int(b) for b in a.busy.split(",")]
        spins = [float(u) for u in a.spin_us.split(",")] if a.spin_us else []
        assert all(b >= 0 for b in counts) and all(u >= 0 for u in spins) and a.gen > 0 and a.rounds > 0
    except (ValueError, AssertionError):
        sys.exit(f"cpu_crew_ab: --busy and --spin-us take lists like 0,2 and --gen / --rounds positive numbers "
                 f"(got --busy {a.busy!r}, --spin-us {a.spin_us!r}, --gen {a.gen}, --rounds {a.rounds})")
    for u in spins:
        ARMS[f"spin{u:g}"] = {"crew": True, "spin_us": u, "revoke": True}
    if not a.no_warm:
        with open(a.model, "rb") as f:
            while f.read(1 << 24):
                pass

    from ds4py.model import Numerics
    from ds4py.quant import jit
    from ds4py.ref.engine import RefModel

    m = RefModel(a.model, numerics=Numerics.ds4(), threads=a.threads)
    if not jit.available():
        sys.exit(f"cpu_crew_ab: numba is unavailable ({jit.unavailable_reason()}): no pooled kernels to compare")
    arms = (["wait"] + ([f"spin{u:g}" for u in spins] or ["spin"]) + (["pool"] if a.pool else [])
            + (["auto"] if a.auto else []))
    for name in arms:                              # compile / load every arm's kernels before the clock
        set_arm(jit, name)
        decode_round(m, 2)
    if getattr(m, "populating", None) is not None:
        m.populating.join()
    print(f"{a.model}, {a.threads} threads, {a.gen} tokens a round, {a.rounds} rounds; spin {jit.SPIN_US:g} us; "
          f"{os.cpu_count()} CPUs")
    out = {"model": a.model, "threads": a.threads, "gen": a.gen, "spin_us": jit.SPIN_US, "runs": []}
    for b in counts:
        procs = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(b)]
        try:
            time.sleep(2.0 if b else 0.0)
            load0 = os.getloadavg()[0]
            rows = {n: [] for n in arms}
            for r in range(a.rounds):
                for name in arms[r % len(arms):] + arms[:r % len(arms)]:
                    set_arm(jit, name)
                    rows[name].append(decode_round(m, a.gen))
            load1 = os.getloadavg()[0]
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
        set_arm(jit, "auto")
        print(f"busy processes {b}: load {load0:.1f} -> {load1:.1f}")
        summary = {}
        for name in arms:
            ms = [w / a.gen * 1e3 for w, _ in rows[name]]
            cpu = [c / a.gen * 1e3 for _, c in rows[name]]
            ratio = [w / v for (w, _), (v, _) in zip(rows[name], rows["wait"])]
            summary[name] = {"ms_min": min(ms), "ms_median": statistics.median(ms), "cpu_ms_median":
                             statistics.median(cpu), "ratio_to_wait_median": statistics.median(ratio), "ms": ms}
            print(f"  {name:5s} ms/token min {min(ms):7.1f} median {statistics.median(ms):7.1f}   "
                  f"CPU ms/token median {statistics.median(cpu):7.1f}   / wait per round: median "
                  f"{statistics.median(ratio):.3f}   rounds " + " ".join(f"{x:.1f}" for x in ms))
        out["runs"].append({"busy": b, "load": [load0, load1], "arms": summary})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
