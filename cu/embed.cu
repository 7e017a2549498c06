// Embedding row gather: out[t, c, :] = float(table[ids[t], :]) for c < copies, F16 or F32 table [vocab, dim].
// The ids come from a device buffer (the previous token's argmax / sampler slot), so a captured decode graph
// never needs the host to know the token. copies = hc gives the residual state X = repeat(h, hc) (MODEL.md §2.1).
#include <cuda_fp16.h>
#include "portable.cuh"

// Launch: grid (n_ids), block (any multiple of 32, e.g. 256); block t copies row ids[t], copies times.
// dim % 2 == 0 and table 4-byte aligned (half2 loads). An id outside [0, vocab) fills its rows with NaN, so a
// bad token is visible instead of reading out of bounds.
extern "C" __global__ void embed_f16(const __half* table, const int* ids, float* out, int dim, int vocab,
                                     int copies) {
    pdl_wait();
    pdl_launch_dependents();
    const int id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * copies * dim;
    const bool bad = id < 0 || id >= vocab;
    const __half2* row = reinterpret_cast<const __half2*>(table + (size_t)(bad ? 0 : id) * dim);
    for (int i = threadIdx.x; i < (dim >> 1); i += blockDim.x) {
        float2 v = __half22float2(row[i]);
        if (bad) v.x = v.y = __int_as_float(0x7fc00000);
        for (int c = 0; c < copies; c++) {
            o[(size_t)c * dim + 2 * i] = v.x;
            o[(size_t)c * dim + 2 * i + 1] = v.y;
        }
    }
}

// As embed_f16 for an F32 table (a GGUF converted with dense f32). Launch: as embed_f16. dim % 2 == 0, table
// 8-byte aligned (float2).
extern "C" __global__ void embed_f32(const float* table, const int* ids, float* out, int dim, int vocab, int copies) {
    pdl_wait();
    pdl_launch_dependents();
    const int id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * copies * dim;
    const bool bad = id < 0 || id >= vocab;
    const float2* row = reinterpret_cast<const float2*>(table + (size_t)(bad ? 0 : id) * dim);
    for (int i = threadIdx.x; i < (dim >> 1); i += blockDim.x) {
        float2 v = row[i];
        if (bad) v.x = v.y = __int_as_float(0x7fc00000);
        for (int c = 0; c < copies; c++) {
            o[(size_t)c * dim + 2 * i] = v.x;
            o[(size_t)c * dim + 2 * i + 1] = v.y;
        }
    }
}
