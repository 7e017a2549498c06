"""The model file mapped into the page tables in the background after open (CPU path, no memory budget).

Why: a decode step reads the routed experts its router picks, and each first touch of a file page is a minor page
fault taken on the kernel threads' time (~1,900-2,100 faults a token on the 4-layer real-width file, 10-20 ms of
system CPU a token over the first tokens). llama.cpp maps its file with MAP_POPULATE at load for the same reason.
Here a daemon thread does it after open, so open stays fast: the dense tensors first (every step reads them),
then the routed experts, through madvise(MADV_POPULATE_READ) with the GIL released (ds4py.gguf.GGUFFile.populate).

Only when the whole file fits in memory: its size plus HEADROOM within MemAvailable, and never inside a memory
cgroup with a limit (there the experts are paged on demand; populating would read the whole file and push the
dense weights out). $DS4PY_POPULATE=0 turns it off, =1 on whatever the memory says. Costs: ~0.7 s of one core's
system time for a 9.5 GB file already in the page cache, and page tables (8 bytes per 4 KB page: ~19 MB there,
kernel memory, not the process's private memory).
"""

from __future__ import annotations

import os
import threading

HEADROOM = 1 << 30


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_memory_limited(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> bool:
    """Whether this process's memory cgroup (v2 memory.max, v1 memory.limit_in_bytes) has a limit, at its own
    level or any level above."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        hid, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and ctrls == "":                          # v2 unified hierarchy
            base, name, unlimited = root, "memory.max", lambda v: v == "max"
        elif "memory" in ctrls.split(","):                      # v1 memory controller
            base, name, unlimited = os.path.join(root, "memory"), "memory.limit_in_bytes", lambda v: int(v) >= 1 << 60
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            try:
                with open(os.path.join(base, *parts[:depth], name)) as f:
                    if not unlimited(f.read().strip()):
                        return True
            except (OSError, ValueError):
                continue
    return False


def wanted(file_size: int) -> bool:
    """The policy above: $DS4PY_POPULATE if 0 / 1, else the file fits in available memory outside a memory cgroup."""
    env = os.environ.get("DS4PY_POPULATE")
    if env in ("0", "1"):
        return env == "1"
    avail = mem_available()
    return avail is not None and file_size + HEADROOM <= avail and not cgroup_memory_limited()


def start(gguf, first: list[tuple[int, int]]) -> threading.Thread | None:
    """A daemon thread that populates the spans `first` ((offset, nbytes): the dense tensors), then the whole file;
    None where the policy says no. The thread holds the mapping until it is done."""
    if not wanted(gguf.file_size):
        return None

    def run() -> None:
        for off, n in first:
            if not gguf.populate(off, n):
                return
        gguf.populate(0, gguf.file_size)

    t = threading.Thread(target=run, name="ds4py-populate", daemon=True)
    t.start()
    return t
