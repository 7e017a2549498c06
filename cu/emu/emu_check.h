// emu_check.h: the emulator's checker builds (ds4py/cuda/emu.py, DS4PY_EMU_CHECK=race / asan; docs/cuda-emu.md).
//
// race (DS4_EMU_RACE): g++ -fsanitize=thread makes every load and store of the kernel call __tsan_readN /
// __tsan_writeN; TSan's own runtime is not linked, these hooks are. An access to shared memory (static __shared__
// or the launch's dynamic shared memory) is checked against the last write and the last two reads of each byte
// in the current barrier interval: two different threads of the block touching one byte with no __syncthreads
// between them (nor a __syncwarp, for two lanes of one warp), at least one writing and not both atomic, fail the
// launch, naming both threads, the address and what each did. Global memory is not checked (blocks of one launch
// are unordered there by design; cross-block results use atomic tickets, cu/README.md).
//
// asan (DS4_EMU_ASAN): the build adds -fsanitize=address,undefined; here the dynamic shared memory area is
// poisoned outside the launch's bytes (so an underflow or an overrun into the alignment padding is reported,
// which the guard page cannot see) and ds4py/cuda/emu.py poisons each argument copy's buffer outside the
// argument's bytes through emu_asan_poison. When AddressSanitizer reports, its death callback prints which
// kernel, thread and block of the emulator was running.
#pragma once

#if defined(DS4_EMU_RACE)
namespace __emu {
namespace race {

struct Access {
    uint32_t interval;    // the block's barrier interval when it happened (0: never)
    uint32_t warp_gen;    // the thread's warp's __syncwarp generation then
    int32_t thread;       // linear thread index in the block
    int32_t atomic;
};
struct Cell { Access w, r1, r2; };     // the last write and the last reads (by two different threads) of one byte

inline uint32_t interval = 1;          // bumped at every barrier release and block start: unique per interval
inline uint32_t generation = 1;        // source of fresh warp generations
inline uint32_t warp_gen[kMaxThreads / kWarp];
inline Cell* dyn_shadow;               // one Cell per byte of dynamic shared memory (kMaxDynSmem)
inline Cell* static_shadow;            // one per byte of the static __shared__ section
inline size_t static_bytes;

EMU_NO_TSAN inline void block_start() {
    interval++;
    for (int w = 0; w < kMaxThreads / kWarp; w++) warp_gen[w] = ++generation;
    if (!dyn_shadow) dyn_shadow = (Cell*)calloc(kMaxDynSmem, sizeof(Cell));
    if (__start_emu_shared && !static_shadow) {
        static_bytes = (size_t)(__stop_emu_shared - __start_emu_shared);
        static_shadow = (Cell*)calloc(static_bytes ? static_bytes : 1, sizeof(Cell));
    }
}
EMU_NO_TSAN inline void barrier() { interval++; }
EMU_NO_TSAN inline void warp_sync(int warp) { warp_gen[warp] = ++generation; }

// Did access `a` (by another thread) happen in this interval without a __syncwarp ordering it before thread t?
EMU_NO_TSAN inline bool unordered(const Access& a, int t) {
    if (a.interval != interval || a.thread == t) return false;
    const int w = t / kWarp;
    return !(a.thread / kWarp == w && a.warp_gen != warp_gen[w]);
}

EMU_NO_TSAN inline void describe(char* out, size_t n, int linear) {
    const unsigned bx = L.block.x, by = L.block.y;
    snprintf(out, n, "thread (%u,%u,%u)", linear % bx, linear / bx % by, linear / (bx * by));
}

[[noreturn]] EMU_NO_TSAN inline void report(const char* kind_now, const Access& then, const char* kind_then,
                                            const void* addr, const char* where, size_t offset) {
    char other[48];
    describe(other, sizeof other, then.thread);
    fail("shared-memory race: %s%s %s byte %zu (address %p) that %s %s%s in the same barrier interval "
         "(no __syncthreads between them)", kind_now, "", where, offset, addr, other, kind_then,
         then.atomic ? " atomically" : "");
}

EMU_NO_TSAN inline void access(const void* p, size_t n, int write, int atomic) {
    if (!L.in_fiber || !L.cur) return;
    const uintptr_t a = (uintptr_t)p;
    Cell* c;
    const char* where;
    size_t off;
    const uintptr_t d0 = (uintptr_t)dyn_smem_ptr, s0 = (uintptr_t)__start_emu_shared;
    if (dyn_shadow && a - d0 < L.dyn_smem) {
        off = a - d0, c = dyn_shadow + off, where = "dynamic shared memory";
        if (off + n > L.dyn_smem) n = L.dyn_smem - off;
    } else if (static_shadow && s0 && a - s0 < static_bytes) {
        off = a - s0, c = static_shadow + off, where = "static __shared__";
        if (off + n > static_bytes) n = static_bytes - off;
    } else {
        return;
    }
    const int t = L.cur->linear;
    const Access now{interval, warp_gen[t / kWarp], t, atomic};
    for (size_t i = 0; i < n; i++, c++) {
        if (unordered(c->w, t) && !(atomic && c->w.atomic))
            report(write ? (atomic ? "an atomic write to" : "a write to") : "a read of", c->w, "wrote", p,
                   where, off + i);
        if (write) {
            if (unordered(c->r1, t)) report(atomic ? "an atomic write to" : "a write to", c->r1, "read", p, where, off + i);
            if (unordered(c->r2, t)) report(atomic ? "an atomic write to" : "a write to", c->r2, "read", p, where, off + i);
            c->w = now;
        } else if (c->r1.interval != interval || c->r1.thread == t) {
            c->r1 = now;
        } else {
            c->r2 = now;
        }
    }
}

}  // namespace race
}  // namespace __emu

// The instrumentation's entry points (what -fsanitize=thread calls), routed to race::access.
#define EMU_TSAN_RW(n) \
    extern "C" EMU_NO_TSAN void __tsan_read##n(void* p) { ::__emu::race::access(p, n, 0, 0); } \
    extern "C" EMU_NO_TSAN void __tsan_write##n(void* p) { ::__emu::race::access(p, n, 1, 0); } \
    extern "C" EMU_NO_TSAN void __tsan_unaligned_read##n(void* p) { ::__emu::race::access(p, n, 0, 0); } \
    extern "C" EMU_NO_TSAN void __tsan_unaligned_write##n(void* p) { ::__emu::race::access(p, n, 1, 0); } \
    extern "C" EMU_NO_TSAN void __tsan_volatile_read##n(void* p) { ::__emu::race::access(p, n, 0, 0); } \
    extern "C" EMU_NO_TSAN void __tsan_volatile_write##n(void* p) { ::__emu::race::access(p, n, 1, 0); }
EMU_TSAN_RW(1) EMU_TSAN_RW(2) EMU_TSAN_RW(4) EMU_TSAN_RW(8) EMU_TSAN_RW(16)
extern "C" EMU_NO_TSAN void __tsan_read_range(void* p, unsigned long n) { ::__emu::race::access(p, n, 0, 0); }
extern "C" EMU_NO_TSAN void __tsan_write_range(void* p, unsigned long n) { ::__emu::race::access(p, n, 1, 0); }
extern "C" EMU_NO_TSAN void __tsan_init() {}
extern "C" EMU_NO_TSAN void __tsan_func_entry(void*) {}
extern "C" EMU_NO_TSAN void __tsan_func_exit() {}
extern "C" EMU_NO_TSAN void __tsan_vptr_update(void*, void*) {}
extern "C" EMU_NO_TSAN void __tsan_vptr_read(void*) {}
#endif  // DS4_EMU_RACE

#if defined(DS4_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>

namespace __emu {
// The launch uses the last `bytes` of one kMaxDynSmem mapping (dyn_smem_area): poison the rest of it.
inline void asan_dyn_smem(unsigned char* p, size_t bytes) {
    unsigned char* end = p + guarded_padded(bytes);
    unsigned char* start = end - guarded_padded(kMaxDynSmem);
    ASAN_UNPOISON_MEMORY_REGION(start, end - start);
    ASAN_POISON_MEMORY_REGION(start, p - start);
    ASAN_POISON_MEMORY_REGION(p + bytes, end - (p + bytes));
}

inline void asan_death() {
    if (L.in_fiber && L.cur) {
        char who[96];
        describe_thread(who, sizeof who, L.cur);
        fprintf(stderr, "ds4py emulator: the error above is in %s of kernel %s\n", who, L.kernel ? L.kernel : "?");
    }
}
struct AsanInit { AsanInit() { __sanitizer_set_death_callback(asan_death); } };
inline AsanInit asan_init;
}  // namespace __emu

EMU_API void emu_asan_poison(void* p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
EMU_API void emu_asan_unpoison(void* p, size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#endif  // DS4_EMU_ASAN
