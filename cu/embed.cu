// Embedding row gather: out[t, :] = float(table[ids[t], :]) for an F16 table [vocab, dim].
#include <cuda_fp16.h>
#include "portable.cuh"

// Launch: grid (n_ids), block (any, e.g. 256); block t copies row ids[t].
// An id outside [0, vocab) fills its row with NaN so a bad token is visible instead of reading out of bounds.
extern "C" __global__ void embed_f16(const __half* table, const int* ids, float* out, int dim, int vocab) {
    pdl_wait();
    pdl_launch_dependents();
    const int id = ids[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * dim;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
        return;
    }
    const __half* row = table + (size_t)id * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = __half2float(row[i]);
}
