// The emulator's execution engine: every CUDA thread of a block is a fiber on its own small stack; blocks run
// one at a time. A fiber runs until it reaches a barrier, a warp collective or its end, then the scheduler moves
// to the next runnable fiber. See cu/README.md for what this can and cannot show.
#pragma once

// The checker builds (ds4py/cuda/emu.py, DS4PY_EMU_CHECK): DS4_EMU_RACE instruments every memory access
// (g++ -fsanitize=thread, with the hooks in emu_check.h instead of TSan's runtime) to find shared-memory races;
// DS4_EMU_ASAN is the AddressSanitizer + UBSan build. The hooks below are no-ops in the plain build.
// DS4_EMU_TRAFFIC is the traffic profiler (emu_check.h): the same -fsanitize=thread hooks, routed to per-warp
// request accounting instead (coalescing, unique bytes, bytes before pdl_wait, shared-memory bank conflicts).
#if defined(DS4_EMU_RACE)
#define EMU_RACE(...) __VA_ARGS__
#else
#define EMU_RACE(...)
#endif
#if defined(DS4_EMU_TRAFFIC)
#define EMU_TRAFFIC(...) __VA_ARGS__
#else
#define EMU_TRAFFIC(...)
#endif
#if defined(DS4_EMU_RACE) || defined(DS4_EMU_TRAFFIC)
#define EMU_NO_TSAN __attribute__((no_sanitize_thread))
#else
#define EMU_NO_TSAN
#endif
#if defined(DS4_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#define EMU_ASAN(...) __VA_ARGS__
#define EMU_NO_ASAN __attribute__((no_sanitize_address))
#else
#define EMU_ASAN(...)
#define EMU_NO_ASAN
#endif

namespace __emu {
#if defined(DS4_EMU_RACE)
namespace race {
inline void block_start();
inline void barrier();
inline void warp_sync(int warp);
inline void access(const void* p, size_t n, int write, int atomic);
}  // namespace race
#endif
#if defined(DS4_EMU_TRAFFIC)
namespace traffic {
void block_start();
void flush();
void access_at(const void* p, size_t n, int write, uintptr_t pc);
__attribute__((noinline)) void cp_async_issued(const void* src, size_t n);
__attribute__((noinline)) void atomic_access(const void* p, size_t n);
}  // namespace traffic
#endif
#if defined(DS4_EMU_ASAN)
inline void asan_dyn_smem(unsigned char* p, size_t bytes);
#endif

enum : int { kWarp = 32, kMaxThreads = 1024, kStackBytes = 64 * 1024, kMaxDynSmem = 227 * 1024 };
enum State : int { READY, AT_BARRIER, AT_WARP, DONE };
enum Result : int { OK = 0, KERNEL_ERROR = 1, FAULT = 2, BAD_LAUNCH = 3 };

// ---- context switching -----------------------------------------------------------------------------------------
#if defined(__x86_64__) && !defined(DS4_EMU_UCONTEXT)
// Callee-saved registers, MXCSR and the x87 control word go on the fiber's own stack; the switch is a few
// instructions, versus a system call per switch for swapcontext.
asm(R"(
    .text
    .p2align 4
    .globl __emu_switch
    .hidden __emu_switch
    .type __emu_switch,@function
__emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size __emu_switch, .-__emu_switch
    .globl __emu_fiber_start
    .hidden __emu_fiber_start
    .type __emu_fiber_start,@function
__emu_fiber_start:
    callq *%r13
    ud2
    .size __emu_fiber_start, .-__emu_fiber_start
)");
extern "C" void __emu_switch(void** save_sp, void* load_sp);
extern "C" void __emu_fiber_start();
struct Context { void* sp; };
inline void ctx_switch(Context* from, Context* to) { __emu_switch(&from->sp, to->sp); }
inline void ctx_make(Context* c, char* stack_lo, size_t size, void (*entry)()) {
    uintptr_t top = ((uintptr_t)(stack_lo + size)) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)(top - 64);                 // after `ret` the fiber starts with rsp = top (16-aligned)
    sp[0] = 0x1f80ull | (0x037full << 32);                // default MXCSR | x87 control word
    sp[1] = sp[2] = 0;                                    // r15 r14
    sp[3] = (uint64_t)entry;                              // r13: called by __emu_fiber_start
    sp[4] = sp[5] = sp[6] = 0;                            // r12 rbx rbp
    sp[7] = (uint64_t)&__emu_fiber_start;                 // return address
    c->sp = sp;
}
#else
}  // namespace __emu
#include <ucontext.h>
namespace __emu {
struct Context { ucontext_t uc; };
inline void ctx_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
inline void ctx_make(Context* c, char* stack_lo, size_t size, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack_lo;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
#endif

// ---- state -----------------------------------------------------------------------------------------------------
struct Site { const char* what; const char* file; int line; };

struct PendingCopy { void* dst; const void* src; int bytes; unsigned group; };

struct Fiber {
    Context ctx;
    char* stack;
    uint3 tid;
    int linear, lane, warp;
    State state;
    Site site;                       // where it waits
    uint64_t in[12], out[4];         // warp-collective payload: this lane's operands, and its result
    int bar_result;
    int waited;                      // has called pdl_wait() (checked with the pdl check on)
    PendingCopy copies[32];          // cp.async issued but not yet waited for
    int ncopies;
    unsigned cp_group;               // index of the group being filled
};

typedef void (*Combine)(Fiber* lanes, unsigned mask);   // computes `out` of every lane in mask from their `in`

struct Group {                       // one warp collective in progress
    unsigned mask, arrived;
    Site site;
    Combine combine;
};

struct Warp {
    unsigned exists, exited;
    Group groups[kWarp];
    int ngroups;
};

struct Launch {
    const char* kernel;              // its name (set by the generated launcher; for the checkers' reports)
    void (*thunk)(void* fn, void** args);
    void* fn;
    void** args;
    dim3 grid, block;
    size_t dyn_smem;
    uint3 block_idx;
    Fiber* fibers;
    int nthreads, live;
    Warp warps[kMaxThreads / kWarp];
    int bar_count, bar_pred;
    Site bar_site;
    Fiber* cur;
    Context sched;
    int* order;                      // this round's thread order, and the position of the running thread in it
    int pos, ran;
    int in_fiber, failed;
    // pdl check: the launch's writable argument buffers stay read-only for threads that have not called
    // pdl_wait() yet; a store from such a thread faults and fails the launch (see pdl_check_* below).
    int pdl_check, pdl_open, pdl_violation, nwatch;
    char* watch_lo[32];
    size_t watch_len[32];
    char msg[2048];
    sigjmp_buf fault_jmp;
    void* fault_addr;
    int fault_sig;
    struct sigaction old_segv, old_bus, old_fpe;
    uint64_t rng;
};

inline Launch L;
inline unsigned char* dyn_smem_ptr;   // the block's dynamic shared memory, as seen by `extern __shared__` arrays
inline char* stack_pool;               // kMaxThreads stacks, each above a PROT_NONE guard page (overflow faults)
inline size_t page_bytes;

}  // namespace __emu

// The built-in variables: the scheduler writes threadIdx before switching into a fiber.
inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
constexpr int warpSize = 32;
extern "C" { __attribute__((aligned(1024))) inline unsigned char __emu_dyn_smem[__emu::kMaxDynSmem]; }
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

namespace __emu {

inline void describe_thread(char* out, size_t n, const Fiber* f) {
    snprintf(out, n, "thread (%u,%u,%u) of block (%u,%u,%u)", f->tid.x, f->tid.y, f->tid.z,
             L.block_idx.x, L.block_idx.y, L.block_idx.z);
}

// Stop the launch with a message: from a fiber, switch back to the scheduler and never return.
[[noreturn]] inline void fail(const char* fmt, ...) {
    char who[96];
    describe_thread(who, sizeof who, L.cur);
    int k = snprintf(L.msg, sizeof L.msg, "%s: ", who);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L.msg + k, sizeof L.msg - k, fmt, ap);
    va_end(ap);
    L.failed = 1;
    ctx_switch(&L.cur->ctx, &L.sched);
    __builtin_trap();
}

inline bool same_site(const Site& a, const Site& b) {
    if (a.line != b.line) return false;
    if (a.file == b.file && a.what == b.what) return true;     // the usual case: the same string literals
    return strcmp(a.file, b.file) == 0 && strcmp(a.what, b.what) == 0;
}

// A thread that blocks hands over straight to the next ready thread of this round (in the round's order) -
// one switch instead of two through the scheduler - or, at the end of the round, to the scheduler.
inline void pdl_before_switch(const Fiber& f);
// Make g (at position k of the round) the running thread; the caller then switches into it.
inline void make_current(Fiber& g, int k) {
    L.pos = k;
    L.ran = 1;
    pdl_before_switch(g);
    L.cur = &g;
    threadIdx = g.tid;
}
inline void yield_to_scheduler(Fiber* f) {
    for (int k = L.pos + 1; k < L.nthreads; k++) {
        Fiber& g = L.fibers[L.order[k]];
        if (g.state != READY) continue;
        make_current(g, k);
        ctx_switch(&f->ctx, &g.ctx);
        return;
    }
    ctx_switch(&f->ctx, &L.sched);
}

// ---- cp.async: copies are held per thread and land at the matching wait ------------------------------------
inline void run_copy(const PendingCopy& c) {
    EMU_RACE(race::access(c.src, c.bytes, 0, 0); race::access(c.dst, c.bytes, 1, 0);)   // by the waiting thread
    memcpy(c.dst, c.src, c.bytes);
}

inline void cp_async(void* dst, const void* src, int bytes) {
    Fiber* f = L.cur;
    EMU_TRAFFIC(traffic::cp_async_issued(src, (size_t)bytes);)     // a global load, by the issuing thread
    if (((uintptr_t)dst | (uintptr_t)src) & (uintptr_t)(bytes - 1))
        fail("cp.async of %d bytes needs %d-byte aligned addresses (dst %p, src %p)", bytes, bytes, dst, src);
    if (f->ncopies == 32) {                      // hardware may finish a copy at any time: retire the oldest
        run_copy(f->copies[0]);
        memmove(f->copies, f->copies + 1, 31 * sizeof(PendingCopy));
        f->ncopies--;
    }
    f->copies[f->ncopies++] = PendingCopy{dst, src, bytes, f->cp_group};
}
inline void cp_async_commit() { L.cur->cp_group++; }
inline void cp_async_wait(int newest_pending) {  // complete every committed group but the newest N
    Fiber* f = L.cur;
    int k = 0;
    for (int i = 0; i < f->ncopies; i++) {
        const PendingCopy& c = f->copies[i];
        if (c.group + (unsigned)newest_pending < f->cp_group) run_copy(c);
        else f->copies[k++] = c;
    }
    f->ncopies = k;
}

// ---- barriers --------------------------------------------------------------------------------------------------
enum BarMode : int { BAR_PLAIN, BAR_COUNT, BAR_AND, BAR_OR };

inline void release_barrier(int mode) {
    int r = 0;
    if (mode == BAR_COUNT) r = L.bar_pred;
    else if (mode == BAR_AND) r = L.bar_pred == L.bar_count;
    else if (mode == BAR_OR) r = L.bar_pred > 0;
    for (int i = 0; i < L.nthreads; i++)
        if (L.fibers[i].state == AT_BARRIER) { L.fibers[i].state = READY; L.fibers[i].bar_result = r; }
    L.bar_count = 0;
    L.bar_pred = 0;
    EMU_RACE(race::barrier();)
    EMU_TRAFFIC(traffic::flush();)     // no lane can run a request from before the barrier any more
}

inline int barrier(Site site, int mode, int pred) {
    Fiber* f = L.cur;
    if (L.bar_count == 0) L.bar_site = site;
    else if (!same_site(site, L.bar_site))
        fail("barrier divergence: reached %s at %s:%d while other threads wait at %s at %s:%d", site.what,
             site.file, site.line, L.bar_site.what, L.bar_site.file, L.bar_site.line);
    f->site = site;
    f->state = AT_BARRIER;
    L.bar_count++;
    L.bar_pred += pred != 0;
    if (L.bar_count == L.live) release_barrier(mode);   // this thread was the last: go on without switching
    else yield_to_scheduler(f);
    return f->bar_result;
}

// ---- warp collectives ----------------------------------------------------------------------------------------
// Every lane named in `mask` must reach the same collective (same intrinsic, source line and mask); the last one
// to arrive computes everybody's result with `combine` and the group resumes. Several groups may be pending in a
// warp at once (lanes 0-15 may wait at a __syncwarp while lanes 16-31 finish a shuffle among themselves); groups
// that wait for each other forever are reported as warp divergence when nothing else can run.
inline void warp_collective(Site site, unsigned mask, Combine combine) {
    Fiber* f = L.cur;
    Warp& w = L.warps[f->warp];
    const unsigned bit = 1u << f->lane;
    if (!(mask & bit)) fail("%s at %s:%d with mask 0x%08x that does not include the calling lane %d", site.what,
                            site.file, site.line, mask, f->lane);
    if (mask & ~w.exists)
        fail("%s at %s:%d: mask 0x%08x names lanes that do not exist (warp %d has lanes 0x%08x; blockDim %u)",
             site.what, site.file, site.line, mask, f->warp, w.exists, L.block.x * L.block.y * L.block.z);
    if (mask & w.exited)
        fail("%s at %s:%d: mask 0x%08x names lanes that have already exited (0x%08x)", site.what, site.file,
             site.line, mask, mask & w.exited);
    Group* g = nullptr;
    for (int i = 0; i < w.ngroups; i++)
        if (w.groups[i].mask == mask && w.groups[i].combine == combine && same_site(w.groups[i].site, site)) {
            g = &w.groups[i];
            break;
        }
    if (!g) {                        // each lane waits in at most one group, so 32 groups always suffice
        g = &w.groups[w.ngroups++];
        *g = Group{mask, 0, site, combine};
    }
    g->arrived |= bit;
    f->site = site;
    f->state = AT_WARP;
    if (g->arrived != mask) { yield_to_scheduler(f); return; }
    Fiber* lanes = L.fibers + f->warp * kWarp;
    g->combine(lanes, mask);
    for (unsigned m = mask; m; m &= m - 1) lanes[__builtin_ctz(m)].state = READY;
    *g = w.groups[--w.ngroups];
}

template <class T> inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp collectives move at most 8 bytes per lane");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T from_bits(uint64_t b) { T v; memcpy(&v, &b, sizeof(T)); return v; }

// Shuffles: in[0] = value, in[1] = source lane (or -1: keep own value). A source lane outside the mask is
// undefined on the GPU; here it reads as all-ones bits (NaN for floats) so tests notice.
inline void combine_shfl(Fiber* lanes, unsigned mask) {
    for (unsigned m = mask; m; m &= m - 1) {
        Fiber& f = lanes[__builtin_ctz(m)];
        const int64_t src = (int64_t)f.in[1];
        if (src < 0) f.out[0] = f.in[0];
        else if (mask & (1u << src)) f.out[0] = lanes[src].in[0];
        else f.out[0] = ~0ull;
    }
}

inline void check_width(Site s, int width) {
    if (width <= 0 || width > 32 || (width & (width - 1)))
        fail("%s at %s:%d: width %d is not a power of two in [1, 32]", s.what, s.file, s.line, width);
}

template <class T> inline T shfl(Site s, unsigned mask, T v, int64_t src) {
    Fiber* f = L.cur;
    f->in[0] = to_bits(v);
    f->in[1] = (uint64_t)src;
    warp_collective(s, mask, combine_shfl);
    return from_bits<T>(f->out[0]);
}
template <class T> inline T shfl_idx(Site s, unsigned mask, T v, int src, int width) {
    check_width(s, width);
    const int lane = L.cur->lane, base = lane & ~(width - 1);
    return shfl(s, mask, v, base + (src & (width - 1)));
}
template <class T> inline T shfl_up(Site s, unsigned mask, T v, unsigned delta, int width) {
    check_width(s, width);
    const int lane = L.cur->lane, base = lane & ~(width - 1);
    const int64_t src = (int64_t)lane - (int64_t)delta;
    return shfl(s, mask, v, src < base ? -1 : src);
}
template <class T> inline T shfl_down(Site s, unsigned mask, T v, unsigned delta, int width) {
    check_width(s, width);
    const int lane = L.cur->lane, base = lane & ~(width - 1);
    const int64_t src = (int64_t)lane + (int64_t)delta;
    return shfl(s, mask, v, src >= base + width ? -1 : src);
}
template <class T> inline T shfl_xor(Site s, unsigned mask, T v, int lane_mask, int width) {
    check_width(s, width);
    const int lane = L.cur->lane, base = lane & ~(width - 1);
    const int src = lane ^ (lane_mask & 31);
    return shfl(s, mask, v, src >= base + width ? -1 : src);   // later groups are out of reach: own value
}

// Votes and reductions: in[0] = operand, out[0] = result (same for all lanes unless noted).
inline void combine_ballot(Fiber* lanes, unsigned mask) {
    unsigned b = 0;
    for (unsigned m = mask; m; m &= m - 1) if (lanes[__builtin_ctz(m)].in[0]) b |= m & -m;
    for (unsigned m = mask; m; m &= m - 1) lanes[__builtin_ctz(m)].out[0] = b;
}
inline void combine_sync(Fiber* lanes, unsigned) { EMU_RACE(race::warp_sync(lanes[0].warp);) (void)lanes; }
inline void combine_match_any(Fiber* lanes, unsigned mask) {
    for (unsigned m = mask; m; m &= m - 1) {
        Fiber& f = lanes[__builtin_ctz(m)];
        unsigned same = 0;
        for (unsigned k = mask; k; k &= k - 1) if (lanes[__builtin_ctz(k)].in[0] == f.in[0]) same |= k & -k;
        f.out[0] = same;
    }
}
template <class T, int OP> inline void combine_reduce(Fiber* lanes, unsigned mask) {
    T acc = from_bits<T>(lanes[__builtin_ctz(mask)].in[0]);
    for (unsigned m = mask & (mask - 1); m; m &= m - 1) {
        const T v = from_bits<T>(lanes[__builtin_ctz(m)].in[0]);
        if (OP == 0) acc = (T)(acc + v);
        else if (OP == 1) acc = v < acc ? v : acc;
        else if (OP == 2) acc = v > acc ? v : acc;
        else if (OP == 3) acc = acc & v;
        else if (OP == 4) acc = acc | v;
        else acc = acc ^ v;
    }
    for (unsigned m = mask; m; m &= m - 1) lanes[__builtin_ctz(m)].out[0] = to_bits(acc);
}
template <class T, int OP> inline T reduce(Site s, unsigned mask, T v) {
    L.cur->in[0] = to_bits(v);
    warp_collective(s, mask, combine_reduce<T, OP>);
    return from_bits<T>(L.cur->out[0]);
}

inline unsigned ballot(Site s, unsigned mask, int pred) {
    L.cur->in[0] = pred != 0;
    warp_collective(s, mask, combine_ballot);
    return (unsigned)L.cur->out[0];
}
inline void syncwarp(Site s, unsigned mask) { warp_collective(s, mask, combine_sync); }
template <class T> inline unsigned match_any(Site s, unsigned mask, T v) {
    L.cur->in[0] = to_bits(v);
    warp_collective(s, mask, combine_match_any);
    return (unsigned)L.cur->out[0];
}

// Tensor-core tile D(16x8,f32) += A(16x16,row) * B(16x8,col) with f16 or bf16 inputs (CVT decodes one 16-bit
// element), with the fragment layout of PTX mma.m16n8k16: lane = 4*g + t holds A rows g and g+8, k columns 2t,2t+1
// (a0,a1) and 2t+8,2t+9 (a2,a3); B k rows 2t,2t+1 (b0) and 2t+8,2t+9 (b1) of column g; C/D rows g and g+8,
// columns 2t,2t+1. The sum is done in double (C first, then k ascending) and rounded once; the hardware's
// accumulation may differ in the last bit. One combine serves both input types.
template <float (*CVT)(unsigned short)> inline void combine_mma(Fiber* lanes, unsigned) {
    double A[16][16], B[16][8], C[16][8];
    auto lo = [](uint64_t w) { return (double)CVT((unsigned short)(w & 0xffff)); };
    auto hi = [](uint64_t w) { return (double)CVT((unsigned short)((w >> 16) & 0xffff)); };
    for (int l = 0; l < 32; l++) {
        const uint64_t* in = lanes[l].in;
        const int g = l >> 2, t = l & 3;
        A[g][2 * t] = lo(in[0]);     A[g][2 * t + 1] = hi(in[0]);
        A[g + 8][2 * t] = lo(in[1]); A[g + 8][2 * t + 1] = hi(in[1]);
        A[g][2 * t + 8] = lo(in[2]); A[g][2 * t + 9] = hi(in[2]);
        A[g + 8][2 * t + 8] = lo(in[3]); A[g + 8][2 * t + 9] = hi(in[3]);
        B[2 * t][g] = lo(in[4]);     B[2 * t + 1][g] = hi(in[4]);
        B[2 * t + 8][g] = lo(in[5]); B[2 * t + 9][g] = hi(in[5]);
        for (int i = 0; i < 4; i++) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = bits_f32((unsigned)in[6 + i]);
    }
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        for (int i = 0; i < 4; i++) {
            const int r = g + 8 * (i >> 1), c = 2 * t + (i & 1);
            double acc = C[r][c];
            for (int k = 0; k < 16; k++) acc += A[r][k] * B[k][c];
            lanes[l].out[i] = f32_bits((float)acc);
        }
    }
}

template <float (*CVT)(unsigned short)>
inline void mma_m16n8k16(Site s, float* d, const unsigned* a, const unsigned* b) {
    Fiber* f = L.cur;
    for (int i = 0; i < 4; i++) f->in[i] = a[i];
    f->in[4] = b[0];
    f->in[5] = b[1];
    for (int i = 0; i < 4; i++) f->in[6 + i] = f32_bits(d[i]);
    warp_collective(s, 0xffffffffu, combine_mma<CVT>);
    for (int i = 0; i < 4; i++) d[i] = bits_f32((unsigned)f->out[i]);
}

// ldmatrix (.m8n8.x4.b16): lane i gives the 16-byte aligned address of row i % 8 of matrix i / 8; lane l gets, for
// each matrix j, the address of its 4 bytes (row l / 4, 16-bit columns 2 (l % 4), 2 (l % 4) + 1), which it then
// reads itself in the kernel's own code (portable.cuh), so the race and traffic builds see each lane's load.
inline void combine_ldsm(Fiber* lanes, unsigned) {
    for (int l = 0; l < 32; l++)
        for (int j = 0; j < 4; j++) lanes[l].out[j] = lanes[8 * j + (l >> 2)].in[0] + 4 * (uint64_t)(l & 3);
}
inline void ldsm_rows(Site s, const void* row, const void** rows) {
    if (reinterpret_cast<uintptr_t>(row) & 15)
        fail("%s at %s:%d: row address %p is not 16-byte aligned", s.what, s.file, s.line, row);
    Fiber* f = L.cur;
    f->in[0] = (uint64_t)reinterpret_cast<uintptr_t>(row);
    warp_collective(s, 0xffffffffu, combine_ldsm);
    for (int j = 0; j < 4; j++) rows[j] = reinterpret_cast<const void*>((uintptr_t)f->out[j]);
}

// ---- thread start and end --------------------------------------------------------------------------------------
inline void thread_exit(Fiber* f) {
    if (L.pdl_check && !f->waited) fail("returned without calling pdl_wait() (every kernel waits first)");
    f->cp_group++;
    cp_async_wait(0);                                   // copies still in flight land before the block ends
    Warp& w = L.warps[f->warp];
    const unsigned bit = 1u << f->lane;
    for (int i = 0; i < w.ngroups; i++)
        if (w.groups[i].mask & bit)
            fail("exited while lanes 0x%08x of its warp wait for it at %s at %s:%d (mask 0x%08x)",
                 w.groups[i].arrived, w.groups[i].site.what, w.groups[i].site.file, w.groups[i].site.line,
                 w.groups[i].mask);
    w.exited |= bit;
    f->state = DONE;
    L.live--;
    // Threads that have exited no longer hold a barrier back (as on sm_70+).
    if (L.bar_count > 0 && L.bar_count == L.live) release_barrier(BAR_PLAIN);
}

inline void fiber_main() {
    Fiber* f = L.cur;
    L.thunk(L.fn, L.args);
    thread_exit(f);
    yield_to_scheduler(f);                               // never resumed: its state is DONE
    __builtin_trap();
}

// ---- faults ----------------------------------------------------------------------------------------------------
// ---- pdl check: no global store and no return before pdl_wait() -------------------------------------------
inline void pdl_protect(int prot) {
    for (int i = 0; i < L.nwatch; i++) mprotect(L.watch_lo[i], L.watch_len[i], prot);
}
inline int pdl_watched(const void* a) {
    for (int i = 0; i < L.nwatch; i++)
        if ((const char*)a >= L.watch_lo[i] && (const char*)a < L.watch_lo[i] + L.watch_len[i]) return 1;
    return 0;
}
inline void pdl_mark() { L.cur->waited = 1; }
// Before a thread that has not waited runs, close the buffers again (a waited thread's store opened them).
inline void pdl_before_switch(const Fiber& f) {
    if (L.pdl_check && L.pdl_open && !f.waited) {
        pdl_protect(PROT_READ);
        L.pdl_open = 0;
    }
}

inline void on_fault(int sig, siginfo_t* si, void*) {
    if (L.in_fiber && L.pdl_check && sig == SIGSEGV && pdl_watched(si->si_addr)) {
        if (L.cur->waited) {                 // a legal store: open the buffers and retry the instruction
            pdl_protect(PROT_READ | PROT_WRITE);
            L.pdl_open = 1;
            return;
        }
        L.pdl_violation = 1;
    }
    if (!L.in_fiber) {                       // the emulator itself crashed: hand over to the previous handler
        sigaction(sig, sig == SIGSEGV ? &L.old_segv : sig == SIGBUS ? &L.old_bus : &L.old_fpe, nullptr);
        return;
    }
    L.fault_sig = sig;
    L.fault_addr = si->si_addr;
    siglongjmp(L.fault_jmp, 1);
}

// `bytes` (rounded up to 16) ending right below a PROT_NONE page, with another guard page in front: the first
// access past the end faults. The start is 16-byte aligned (what vector loads need).
inline size_t guarded_padded(size_t bytes) { return (bytes + 15) & ~(size_t)15; }
inline size_t guarded_body(size_t bytes) { return (guarded_padded(bytes) + page_bytes - 1) / page_bytes * page_bytes; }
inline void* guarded_map(size_t bytes) {
    const size_t body = guarded_body(bytes);
    char* base = (char*)mmap(nullptr, body + 2 * page_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == (char*)MAP_FAILED) return nullptr;
    mprotect(base, page_bytes, PROT_NONE);
    mprotect(base + page_bytes + body, page_bytes, PROT_NONE);
    return base + page_bytes + body - guarded_padded(bytes);
}
inline char* guarded_base(void* p, size_t bytes) {
    return (char*)p + guarded_padded(bytes) - guarded_body(bytes) - page_bytes;
}
inline void guarded_unmap(void* p, size_t bytes) { munmap(guarded_base(p, bytes), guarded_body(bytes) + 2 * page_bytes); }

// Dynamic shared memory: one mapping of the largest size a block may have, kept for the process; a launch uses
// its last `bytes` (so the end still sits right below the guard page) instead of mapping memory every time.
inline unsigned char* dyn_smem_area(size_t bytes) {
    static unsigned char* end = nullptr;
    if (!end) {
        unsigned char* p = (unsigned char*)guarded_map(kMaxDynSmem);
        if (!p) return nullptr;
        end = p + guarded_padded(kMaxDynSmem);
    }
    return end - guarded_padded(bytes);
}

inline bool ensure_stacks() {
    if (stack_pool) return true;
    page_bytes = (size_t)sysconf(_SC_PAGESIZE);
    const size_t slot = kStackBytes + page_bytes;
    void* p = mmap(nullptr, slot * kMaxThreads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return false;
    for (int i = 0; i < kMaxThreads; i++) mprotect((char*)p + i * slot, page_bytes, PROT_NONE);
    stack_pool = (char*)p;
    return true;
}

// Nobody can run. Two pending collectives of one warp whose masks overlap wait for each other: warp divergence.
// Otherwise name who waits where, in runs of consecutive threads.
inline void report_deadlock() {
    L.failed = 1;
    for (int wi = 0; wi < (L.nthreads + kWarp - 1) / kWarp; wi++) {
        const Warp& w = L.warps[wi];
        for (int i = 0; i < w.ngroups; i++)
            for (int j = i + 1; j < w.ngroups; j++) {
                const Group &a = w.groups[i], &b = w.groups[j];
                if (!(a.mask & b.mask)) continue;
                snprintf(L.msg, sizeof L.msg, "warp divergence in warp %d of block (%u,%u,%u): lanes 0x%08x wait at "
                         "%s at %s:%d (mask 0x%08x) while lanes 0x%08x wait at %s at %s:%d (mask 0x%08x)", wi,
                         L.block_idx.x, L.block_idx.y, L.block_idx.z, a.arrived, a.site.what, a.site.file,
                         a.site.line, a.mask, b.arrived, b.site.what, b.site.file, b.site.line, b.mask);
                return;
            }
    }
    int k = snprintf(L.msg, sizeof L.msg, "deadlock in block (%u,%u,%u):", L.block_idx.x, L.block_idx.y,
                     L.block_idx.z);
    for (int i = 0; i < L.nthreads && k < (int)sizeof L.msg - 160;) {
        const Fiber& f = L.fibers[i];
        int j = i + 1;
        if (f.state == DONE) {
            while (j < L.nthreads && L.fibers[j].state == DONE) j++;
            k += snprintf(L.msg + k, sizeof L.msg - k, " threads %d-%d exited;", i, j - 1);
        } else {
            while (j < L.nthreads && L.fibers[j].state == f.state && same_site(L.fibers[j].site, f.site)) j++;
            k += snprintf(L.msg + k, sizeof L.msg - k, " threads %d-%d wait at %s (%s:%d);", i, j - 1,
                          f.site.what, f.site.file, f.site.line);
        }
        i = j;
    }
}

inline uint64_t next_random() {
    L.rng ^= L.rng << 13;
    L.rng ^= L.rng >> 7;
    L.rng ^= L.rng << 17;
    return L.rng;
}

// order: 0 = ascending thread/block index, 1 = descending, 2 = a fresh random order every round (seeded).
inline void make_order(int* idx, int n, int order) {
    for (int i = 0; i < n; i++) idx[i] = order == 1 ? n - 1 - i : i;
    if (order == 2)
        for (int i = n - 1; i > 0; i--) { int j = (int)(next_random() % (uint64_t)(i + 1)); int t = idx[i]; idx[i] = idx[j]; idx[j] = t; }
}

// Static __shared__ starts as all-ones bytes too. A volatile byte loop, not memset: the AddressSanitizer build
// puts redzones between the section's variables (-fsanitize-sections), which its memset would report.
EMU_NO_ASAN EMU_NO_TSAN inline void poison_static_smem() {
    if (!__start_emu_shared || !__stop_emu_shared) return;
#if defined(DS4_EMU_ASAN)
    for (volatile char* q = __start_emu_shared; q < __stop_emu_shared; q++) *q = (char)0xff;
#else
    memset(__start_emu_shared, 0xff, __stop_emu_shared - __start_emu_shared);
#endif
}

inline bool run_block(uint3 b, int order) {
    L.block_idx = b;
    blockIdx = b;
    const int n = L.nthreads;
    for (int i = 0; i < n; i++) {
        Fiber& f = L.fibers[i];
        f.stack = stack_pool + (size_t)i * (kStackBytes + page_bytes) + page_bytes;
        f.linear = i;
        f.tid = uint3{(unsigned)(i % L.block.x), (unsigned)(i / L.block.x % L.block.y),
                      (unsigned)(i / (L.block.x * L.block.y))};
        f.lane = i % kWarp;
        f.warp = i / kWarp;
        f.state = READY;
        f.ncopies = 0;
        f.cp_group = 0;
        f.waited = 0;
        ctx_make(&f.ctx, f.stack, kStackBytes, fiber_main);
    }
    for (int w = 0; w < (n + kWarp - 1) / kWarp; w++) {
        const int lanes = n - w * kWarp < kWarp ? n - w * kWarp : kWarp;
        L.warps[w].exists = lanes == 32 ? ~0u : (1u << lanes) - 1u;
        L.warps[w].exited = 0;
        L.warps[w].ngroups = 0;
    }
    L.live = n;
    L.bar_count = L.bar_pred = 0;
    // Shared memory starts as garbage on the GPU; all-ones bytes (NaN, -1) make reads before writes visible.
    memset(dyn_smem_ptr, 0xff, L.dyn_smem);
    poison_static_smem();
    EMU_RACE(race::block_start();)
    EMU_TRAFFIC(traffic::block_start();)
    static int idx[kMaxThreads];
    L.order = idx;
    while (L.live > 0) {
        L.ran = 0;
        make_order(idx, n, order);
        // Run the round: the first ready thread is switched in from here; each one that blocks passes on to the
        // next ready one (yield_to_scheduler), and the last of the round comes back.
        for (int k = 0; k < n; k++) {
            Fiber& f = L.fibers[idx[k]];
            if (f.state != READY) continue;
            make_current(f, k);
            L.in_fiber = 1;
            ctx_switch(&L.sched, &f.ctx);
            L.in_fiber = 0;
            if (L.failed) return false;
            k = L.pos;                                   // the chain ran up to here
        }
        if (!L.ran) { report_deadlock(); return false; }
    }
    EMU_TRAFFIC(traffic::flush();)
    return true;
}

// static_dyn: the module declares `extern __shared__` at file scope, aliased to the fixed __emu_dyn_smem buffer;
// otherwise each launch maps exactly dyn_smem bytes ending at a guard page.
inline int launch(void (*thunk)(void*, void**), void* fn, const unsigned* grid, const unsigned* block,
                  size_t dyn_smem, void** args, int order, uint64_t seed, bool static_dyn) {
    L.msg[0] = 0;
    L.failed = 0;
    L.fault_addr = nullptr;
    L.fault_sig = 0;
    L.pdl_violation = 0;
    if (L.pdl_check) {
        pdl_protect(PROT_READ);
        L.pdl_open = 0;
    }
    const uint64_t nthreads = (uint64_t)block[0] * block[1] * block[2];
    if (!grid[0] || !grid[1] || !grid[2] || !nthreads) {
        snprintf(L.msg, sizeof L.msg, "launch with a zero grid or block dimension");
        return BAD_LAUNCH;
    }
    if (nthreads > kMaxThreads || block[0] > 1024 || block[1] > 1024 || block[2] > 64) {
        snprintf(L.msg, sizeof L.msg, "block (%u,%u,%u) exceeds the CUDA limits (1024 threads, z <= 64)",
                 block[0], block[1], block[2]);
        return BAD_LAUNCH;
    }
    if (grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535) {
        snprintf(L.msg, sizeof L.msg, "grid (%u,%u,%u) exceeds the CUDA limits", grid[0], grid[1], grid[2]);
        return BAD_LAUNCH;
    }
    if (dyn_smem > (size_t)kMaxDynSmem) {
        snprintf(L.msg, sizeof L.msg, "dynamic shared memory %zu bytes exceeds the %d bytes a block can have",
                 dyn_smem, (int)kMaxDynSmem);
        return BAD_LAUNCH;
    }
    if (!ensure_stacks()) { snprintf(L.msg, sizeof L.msg, "cannot map fiber stacks"); return BAD_LAUNCH; }
    dyn_smem_ptr = static_dyn ? __emu_dyn_smem : dyn_smem_area(dyn_smem);
    EMU_ASAN(if (!static_dyn && dyn_smem_ptr) asan_dyn_smem(dyn_smem_ptr, dyn_smem);)
    if (!dyn_smem_ptr) { snprintf(L.msg, sizeof L.msg, "cannot map dynamic shared memory"); return BAD_LAUNCH; }
    static Fiber fibers[kMaxThreads];
    L.fibers = fibers;
    L.nthreads = (int)nthreads;
    L.thunk = thunk;
    L.fn = fn;
    L.args = args;
    L.dyn_smem = dyn_smem;
    L.grid = dim3(grid[0], grid[1], grid[2]);
    L.block = dim3(block[0], block[1], block[2]);
    gridDim = L.grid;
    blockDim = L.block;
    L.rng = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;

    // Catch out-of-bounds accesses (guard pages around every buffer), stack overflows and integer division by
    // zero inside the kernel, and turn them into an error for this launch instead of a crash.
    static char altstack[64 * 1024];
    stack_t ss{}, old_ss{};
    ss.ss_sp = altstack;
    ss.ss_size = sizeof altstack;
    sigaltstack(&ss, &old_ss);
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &L.old_segv);
    sigaction(SIGBUS, &sa, &L.old_bus);
    sigaction(SIGFPE, &sa, &L.old_fpe);

    int result = OK;
    // Blocks in the chosen order; "random" walks them as lin = (a*i + c) mod N with gcd(a, N) = 1.
    static volatile uint64_t i_block;
    const uint64_t nblocks = (uint64_t)grid[0] * grid[1] * grid[2];
    uint64_t a = 1, c = 0;
    if (order == 2 && nblocks > 1) {
        auto gcd = [](uint64_t x, uint64_t y) { while (y) { uint64_t t = x % y; x = y; y = t; } return x; };
        do a = 1 + next_random() % (nblocks - 1); while (gcd(a, nblocks) != 1);
        c = next_random() % nblocks;
    }
    if (sigsetjmp(L.fault_jmp, 1) == 0) {
        for (i_block = 0; i_block < nblocks; i_block = i_block + 1) {
            const uint64_t i = i_block;
            const uint64_t lin = order == 1 ? nblocks - 1 - i : order == 2 ? (uint64_t)(((unsigned __int128)a * i + c) % nblocks) : i;
            const uint3 b{(unsigned)(lin % grid[0]), (unsigned)(lin / grid[0] % grid[1]),
                          (unsigned)(lin / ((uint64_t)grid[0] * grid[1]))};
            if (!run_block(b, order)) { result = KERNEL_ERROR; break; }
        }
    } else {
        L.in_fiber = 0;
        char who[96];
        describe_thread(who, sizeof who, L.cur);
        const char* kind = L.pdl_violation ? "store to global memory before pdl_wait()"
                         : L.fault_sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                         : L.fault_sig == SIGBUS ? "bus error" : "invalid memory access";
        const uintptr_t a = (uintptr_t)L.fault_addr, lo = (uintptr_t)stack_pool;
        const bool stack = L.fault_sig == SIGSEGV && a >= lo && a < lo + (kStackBytes + page_bytes) * kMaxThreads &&
                           (a - lo) % (kStackBytes + page_bytes) < page_bytes;
        const uintptr_t dyn_end = (uintptr_t)dyn_smem_ptr + guarded_padded(dyn_smem);
        const bool dyn = !static_dyn && a >= dyn_end && a < dyn_end + page_bytes;
        char where[96] = "";
        if (stack) snprintf(where, sizeof where, " (the emulator gives each thread 64 KiB)");
        if (dyn) snprintf(where, sizeof where, ": %zu bytes past the end of dynamic shared memory (%zu bytes)",
                          (size_t)(a - (uintptr_t)dyn_smem_ptr) - dyn_smem, dyn_smem);
        snprintf(L.msg, sizeof L.msg, "%s: %s at address %p%s", who, stack ? "stack overflow" : kind, L.fault_addr,
                 where);
        result = FAULT;
    }
    // A failed launch leaves its fibers' frames (and their AddressSanitizer redzones) on the stacks.
    EMU_ASAN(if (result != OK) ASAN_UNPOISON_MEMORY_REGION(stack_pool, (kStackBytes + page_bytes) * nthreads);)
    sigaction(SIGSEGV, &L.old_segv, nullptr);
    sigaction(SIGBUS, &L.old_bus, nullptr);
    sigaction(SIGFPE, &L.old_fpe, nullptr);
    sigaltstack(&old_ss, nullptr);
    return result;
}

// Call the kernel with its parameters read from the cuLaunchKernel-style array; each thread gets its own copy.
template <class... A, size_t... I> inline void call_kernel(void* fn, void** args, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A> inline void thunk(void* fn, void** args) { call_kernel<A...>(fn, args, std::index_sequence_for<A...>{}); }
template <class... A> inline int launch_kernel(void (*k)(A...), const unsigned* grid, const unsigned* block,
                                               size_t dyn_smem, void** args, int order, uint64_t seed,
                                               bool static_dyn) {
    return launch(&thunk<A...>, reinterpret_cast<void*>(k), grid, block, dyn_smem, args, order, seed, static_dyn);
}

}  // namespace __emu
