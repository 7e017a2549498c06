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

#if defined(DS4_EMU_TRAFFIC)
// traffic (DS4_EMU_TRAFFIC): the same -fsanitize=thread hooks as the race build, routed to a memory-traffic
// profile of the launch (ds4py/cuda/traffic.py reads it; docs/cuda-emu.md "Traffic profile").
//
// Warp requests. The GPU issues one memory request per warp per executed load/store instruction, for the lanes
// that execute it together. Here each lane is a fiber that runs on its own until a barrier or collective, so the
// lanes' accesses arrive one lane after another. They are regrouped by a key that is the same for the lanes the
// hardware would serve together: (warp, static instruction, how many times this lane has executed that
// instruction in this block). The static instruction is the hook's return address (the call g++ placed right
// after the load or store; one per access site, unrolled copies each their own); the count is a per-lane
// counter per instruction, so lane 3's 5th pass through a loop's load meets lane 7's 5th pass, as under SIMT
// (lanes with fewer passes simply drop out of the later requests, as inactive lanes do). Requests are complete
// at a barrier release (no lane can still execute an instruction of the earlier interval's count) and at the
// block's end; the buffered accesses are then sorted by key and each request measured.
#include <algorithm>
#include <vector>

namespace __emu {
namespace traffic {

enum : int { kMaxArgs = 64, kSmemDyn = 254, kSmemStatic = 253, kNone = 255 };
// Per argument: loads [requests, requested bytes, distinct bytes per request summed, sectors, lines, unique bytes,
// bytes summed over blocks of the bytes each block loaded, bytes loaded before pdl_wait], then the same first five
// for stores (atomics count as stores), then the distinct 32-byte sectors the launch loaded (what DRAM serves at
// best). Per shared-memory kind (load, store): requests, wavefronts, ideal.
enum : int { L_REQ, L_BYTES, L_DISTINCT, L_SECT, L_LINES, L_UNIQUE, L_BLOCK_UNIQUE, L_PRE_PDL,
             S_REQ, S_BYTES, S_DISTINCT, S_SECT, S_LINES, L_USECT, kCounters };

struct Arg { uintptr_t lo; size_t n; uint32_t* stamp; uint8_t* sector; uint64_t c[kCounters]; };
struct Rec { uint64_t pc; uint32_t occ; uint16_t warp; uint8_t kind, write; uintptr_t addr; uint32_t size; };
struct Occ { uint64_t key; uint32_t gen, count; };

inline int active, nargs;
inline Arg args[kMaxArgs];
inline uint64_t smem[2][3];
inline uint32_t block_serial, gen;
inline std::vector<Rec> recs;
inline std::vector<Occ> occ_table;
inline size_t occ_used;

EMU_NO_TSAN inline uint32_t& occ_slot(uint64_t key) {
    if (occ_table.empty()) occ_table.resize(1 << 14);
    if (2 * (occ_used + 1) > occ_table.size()) {          // grow: keep only this block's entries
        std::vector<Occ> old;
        old.swap(occ_table);
        occ_table.assign(old.size() * 2, Occ{0, 0, 0});
        occ_used = 0;
        for (const Occ& o : old)
            if (o.gen == gen) occ_slot(o.key) = o.count;
    }
    const size_t mask = occ_table.size() - 1;
    size_t i = (size_t)((key * 0x9e3779b97f4a7c15ull) >> 20) & mask;
    for (;; i = (i + 1) & mask) {
        Occ& o = occ_table[i];
        if (o.gen != gen) { o = Occ{key, gen, 0}; occ_used++; return o.count; }   // stale entries are free
        if (o.key == key) return o.count;
    }
}

EMU_NO_TSAN void block_start() {
    gen++;
    occ_used = 0;
    block_serial++;
    recs.clear();
}

EMU_NO_TSAN inline int classify(uintptr_t a, size_t n) {
    for (int i = 0; i < nargs; i++)
        if (a - args[i].lo < args[i].n) return i;
    const uintptr_t d0 = (uintptr_t)dyn_smem_ptr, s0 = (uintptr_t)__start_emu_shared;
    if (d0 && a - d0 < L.dyn_smem) return kSmemDyn;
    if (s0 && a - s0 < (size_t)(__stop_emu_shared - __start_emu_shared)) return kSmemStatic;
    (void)n;
    return kNone;                                          // the thread's stack, the emulator's own state
}

EMU_NO_TSAN void access_at(const void* p, size_t n, int write, uintptr_t pc) {
    if (!active || !L.in_fiber || !L.cur || !n) return;
    const uintptr_t a = (uintptr_t)p;
    const int kind = classify(a, n);
    if (kind == kNone) return;
    Fiber* f = L.cur;
    if (kind < kMaxArgs && !write) {
        Arg& g = args[kind];
        if (!f->waited) g.c[L_PRE_PDL] += n;
        size_t off = a - g.lo, end = off + n < g.n ? off + n : g.n;
        for (; off < end; off++) {
            uint32_t& s = g.stamp[off];
            if (s == block_serial) continue;
            if (!s) {
                g.c[L_UNIQUE]++;
                if (!g.sector[off >> 5]) { g.sector[off >> 5] = 1; g.c[L_USECT]++; }
            }
            g.c[L_BLOCK_UNIQUE]++;
            s = block_serial;
        }
    }
    uint32_t& count = occ_slot((uint64_t)pc << 10 | (uint64_t)f->linear);
    recs.push_back(Rec{pc, count++, (uint16_t)f->warp, (uint8_t)kind, (uint8_t)write, a, (uint32_t)n});
}

__attribute__((noinline)) EMU_NO_TSAN void cp_async_issued(const void* src, size_t n) {
    access_at(src, n, 0, (uintptr_t)__builtin_return_address(0));
}
__attribute__((noinline)) EMU_NO_TSAN void atomic_access(const void* p, size_t n) {
    access_at(p, n, 1, (uintptr_t)__builtin_return_address(0));
}

// One warp request: accesses [b, e) of recs (same warp, instruction, pass, target).
EMU_NO_TSAN inline void measure(const Rec* b, const Rec* e, std::vector<uint64_t>& units) {
    const int kind = b->kind, write = b->write;
    if (kind == kSmemDyn || kind == kSmemStatic) {
        // 32 banks of 4 bytes: lanes reading one word share it (broadcast); distinct words in one bank take one
        // wavefront each. Wide (8 / 16-byte) accesses cover several words; the ideal is ceil(words / 32).
        const uintptr_t base = kind == kSmemDyn ? (uintptr_t)dyn_smem_ptr : (uintptr_t)__start_emu_shared;
        units.clear();
        for (const Rec* r = b; r < e; r++)
            for (uintptr_t w = (r->addr - base) >> 2; w <= (r->addr - base + r->size - 1) >> 2; w++) units.push_back(w);
        std::sort(units.begin(), units.end());
        units.erase(std::unique(units.begin(), units.end()), units.end());
        unsigned per_bank[32] = {0};
        unsigned worst = 0;
        for (uint64_t w : units) worst = std::max(worst, ++per_bank[w & 31]);
        uint64_t* s = smem[write];
        s[0] += 1;
        s[1] += worst;
        s[2] += (units.size() + 31) / 32;
        return;
    }
    Arg& g = args[kind];
    uint64_t* c = g.c + (write ? S_REQ : L_REQ);
    uint64_t bytes = 0;
    units.clear();
    for (const Rec* r = b; r < e; r++) {
        bytes += r->size;
        for (uintptr_t x = r->addr - g.lo; x < r->addr - g.lo + r->size; x++) units.push_back(x);
    }
    std::sort(units.begin(), units.end());
    units.erase(std::unique(units.begin(), units.end()), units.end());
    uint64_t sectors = 0, lines = 0, last_s = ~0ull, last_l = ~0ull;
    for (uint64_t x : units) {                             // sorted: a new sector / line when the index changes
        if ((x >> 5) != last_s) { sectors++; last_s = x >> 5; }
        if ((x >> 7) != last_l) { lines++; last_l = x >> 7; }
    }
    c[0] += 1;
    c[1] += bytes;
    c[2] += units.size();
    c[3] += sectors;
    c[4] += lines;
}

EMU_NO_TSAN void flush() {
    if (!active || recs.empty()) return;
    std::sort(recs.begin(), recs.end(), [](const Rec& x, const Rec& y) {
        if (x.warp != y.warp) return x.warp < y.warp;
        if (x.pc != y.pc) return x.pc < y.pc;
        if (x.occ != y.occ) return x.occ < y.occ;
        return x.kind < y.kind;
    });
    static std::vector<uint64_t> units;
    const Rec* r = recs.data();
    const Rec* end = r + recs.size();
    while (r < end) {
        const Rec* q = r + 1;
        while (q < end && q->warp == r->warp && q->pc == r->pc && q->occ == r->occ && q->kind == r->kind) q++;
        measure(r, q, units);
        r = q;
    }
    recs.clear();
}

}  // namespace traffic
}  // namespace __emu

#define EMU_TRAFFIC_RW(n) \
    extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_read##n(void* p) { ::__emu::traffic::access_at(p, n, 0, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_write##n(void* p) { ::__emu::traffic::access_at(p, n, 1, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_unaligned_read##n(void* p) { ::__emu::traffic::access_at(p, n, 0, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_unaligned_write##n(void* p) { ::__emu::traffic::access_at(p, n, 1, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_volatile_read##n(void* p) { ::__emu::traffic::access_at(p, n, 0, (uintptr_t)__builtin_return_address(0)); } \
    extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_volatile_write##n(void* p) { ::__emu::traffic::access_at(p, n, 1, (uintptr_t)__builtin_return_address(0)); }
EMU_TRAFFIC_RW(1) EMU_TRAFFIC_RW(2) EMU_TRAFFIC_RW(4) EMU_TRAFFIC_RW(8) EMU_TRAFFIC_RW(16)
extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_read_range(void* p, unsigned long n) { ::__emu::traffic::access_at(p, n, 0, (uintptr_t)__builtin_return_address(0)); }
extern "C" __attribute__((noinline)) EMU_NO_TSAN void __tsan_write_range(void* p, unsigned long n) { ::__emu::traffic::access_at(p, n, 1, (uintptr_t)__builtin_return_address(0)); }
extern "C" EMU_NO_TSAN void __tsan_init() {}
extern "C" EMU_NO_TSAN void __tsan_func_entry(void*) {}
extern "C" EMU_NO_TSAN void __tsan_func_exit() {}
extern "C" EMU_NO_TSAN void __tsan_vptr_update(void*, void*) {}
extern "C" EMU_NO_TSAN void __tsan_vptr_read(void*) {}

// The profile of the next launches: n argument buffers [lo[i], lo[i] + len[i]); n = -1 ends it. emu_traffic_read
// copies the counters out: kCounters per argument, then smem loads (requests, wavefronts, ideal) and stores.
EMU_API int emu_traffic_begin(int n, void** lo, const size_t* len) {
    using namespace ::__emu::traffic;
    for (int i = 0; i < nargs; i++) { free(args[i].stamp); free(args[i].sector); }
    nargs = 0;
    active = 0;
    if (n < 0) return 0;
    if (n > kMaxArgs) return -1;
    for (int i = 0; i < n; i++) {
        args[i] = Arg{(uintptr_t)lo[i], len[i], (uint32_t*)calloc(len[i] ? len[i] : 1, 4),
                      (uint8_t*)calloc(len[i] / 32 + 1, 1), {0}};
        if (!args[i].stamp || !args[i].sector) return -1;
    }
    nargs = n;
    memset(smem, 0, sizeof smem);
    block_serial = 0;
    recs.clear();
    active = 1;
    return 0;
}
EMU_API int emu_traffic_counters() { return ::__emu::traffic::kCounters; }
EMU_API void emu_traffic_read(uint64_t* out) {
    using namespace ::__emu::traffic;
    for (int i = 0; i < nargs; i++) memcpy(out + (size_t)i * kCounters, args[i].c, sizeof args[i].c);
    memcpy(out + (size_t)nargs * kCounters, smem, sizeof smem);
}
#endif  // DS4_EMU_TRAFFIC
