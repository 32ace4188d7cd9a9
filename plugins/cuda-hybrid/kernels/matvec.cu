// Quantised mat-vec and small-batch mat-mul: out[b][r] = dot(weight row r, activation row b).
//
// Weights stay in their GGUF encoding (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) exactly as
// they are in the file. A row is walked in *units* of 32 values (one Q8_0 / Q4_0 block, one
// 32-value sub-block of a K-quant super-block, 32 floats): lane `l` of the warp that owns weight row `r` decodes
// units l, l + 32, l + 64, ... once, into registers, and multiplies each decoded unit with the
// same 32 values of every activation row of its block (up to MM_COLS rows) before moving on.
// So a launch with k <= MM_COLS activation rows reads every weight byte once for all k rows.
//
// The per-row arithmetic does not depend on how many activation rows share the launch: lane
// sums are accumulated unit by unit in a fixed order, then reduced by the fixed butterfly of
// `warp_sum`. Row b of a k-row launch is therefore bit-identical to a one-row launch with that
// activation row (the verify / single-token parity the speculative loop relies on).
//
// Q8_0 weights multiply Q8_0-quantised activations (as the CPU backend and ggml do): an exact
// integer dot per block times d_w * d_x. The other types multiply f32 activations.
//
// Launch shape of every `matmul_*` kernel: blockDim = (32 * MM_WARPS), grid =
// (ceil(rows / MM_WARPS), ceil(n / MM_COLS)). Block (x, y) computes weight rows
// x*MM_WARPS .. x*MM_WARPS+3 (one per warp) for activation rows y*MM_COLS .. y*MM_COLS+7.
//
// `matmul_ids_*` (mixture-of-experts): the weight tensor is a stack of matrices of
// `matrix_bytes` bytes; pair p (blockIdx.y) uses matrix ids[p] and activation row p / x_div,
// and writes output row p. Launch shape: blockDim = (32 * MM_WARPS), grid =
// (ceil(rows / MM_WARPS), pairs).

#define MM_WARPS 4
#define MM_COLS 8

// ---- decoders: the 32 values of unit `u` of a row (values u*32 .. u*32 + 31) ----------------

struct DecF32 {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const float* p = (const float*)row + (u64)u * 32;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            v[i] = i < count ? p[i] : 0.0f;
        }
    }
};

struct DecF16 {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const u16* p = (const u16*)row + (u64)u * 32;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            v[i] = i < count ? f16_to_f32(p[i]) : 0.0f;
        }
    }
};

struct DecBF16 {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const u16* p = (const u16*)row + (u64)u * 32;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            v[i] = i < count ? bf16_to_f32(p[i]) : 0.0f;
        }
    }
};

// Q4_0 block (18 bytes, 32 values): d (f16), 16 bytes of 4-bit quants; value i is
// d * ((qs[i] & 0xF) - 8) for i < 16 and d * ((qs[i - 16] >> 4) - 8) for the upper half.
struct DecQ40 {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const u8* b = row + (u64)u * 18;
        const float d = f16_to_f32(load_u16(b));
        const u8* q = b + 2;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            v[i] = d * (float)((int)(q[i] & 0xF) - 8);
            v[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
        }
    }
};

// The scale d*sc and offset dmin*m of sub-block j of the Q4_K / Q5_K super-block at b, which
// starts with d (f16), dmin (f16) and 12 bytes packing the 6-bit sc and m of its 8 sub-blocks.
__device__ __forceinline__ void k4_scale_min(const u8* b, int j, float* scale, float* offset) {
    const u8* sc = b + 4;
    int s, m;
    if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
    *scale = f16_to_f32(load_u16(b)) * (float)s;
    *offset = f16_to_f32(load_u16(b + 2)) * (float)m;
}

// Q4_K super-block (144 bytes, 256 values): d (f16), dmin (f16), 12 bytes of packed 6-bit
// scales and mins, 128 bytes of 4-bit quants. Sub-block j uses scale/min pair j; its quants are
// the low (j even) or high (j odd) nibbles of bytes (j/2)*32 ..; value = d*sc*q - dmin*m.
struct DecQ4K {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const u8* b = row + (u64)(u >> 3) * 144;
        const int j = u & 7;
        float d1, m1;
        k4_scale_min(b, j, &d1, &m1);
        const u8* q = b + 16 + (j >> 1) * 32;
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            v[i] = d1 * (float)((q[i] >> shift) & 0xF) - m1;
        }
    }
};

// Q5_K super-block (176 bytes, 256 values): d (f16), dmin (f16), 12 bytes of scales and mins
// packed as Q4_K's, qh (32 bytes, the fifth bits), qs (128 bytes, the low 4 bits). Sub-block j
// takes low bits as Q4_K does and its fifth bit from bit j of qh[i]; value = d*sc*q - dmin*m.
struct DecQ5K {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const u8* b = row + (u64)(u >> 3) * 176;
        const int j = u & 7;
        float d1, m1;
        k4_scale_min(b, j, &d1, &m1);
        const u8* qh = b + 16;
        const u8* q = b + 48 + (j >> 1) * 32;
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int low = (q[i] >> shift) & 0xF;
            const int high = (qh[i] >> j) & 1;
            v[i] = d1 * (float)(low | (high << 4)) - m1;
        }
    }
};

// Q6_K super-block (210 bytes, 256 values): ql (128 bytes, low 4 bits), qh (64 bytes, high 2
// bits), 16 int8 scales, d (f16). Sub-block j = 4*h + qq (h = 128-value half, qq = quarter):
// low bits from ql[h*64 + (qq&1)*32 + l] (low nibble for qq < 2, high nibble otherwise), high
// bits from qh[h*32 + l] >> 2*qq, scale sc[h*8 + l/16 + 2*qq]; value = d * sc * (q - 32).
struct DecQ6K {
    static __device__ __forceinline__ void decode(const u8* row, int u, int count, float* v) {
        const u8* b = row + (u64)(u >> 3) * 210;
        const int j = u & 7;
        const int h = j >> 2;
        const int qq = j & 3;
        const float d = f16_to_f32(load_u16(b + 208));
        const u8* ql = b + h * 64 + (qq & 1) * 32;
        const u8* qh = b + 128 + h * 32;
        const i8* sc = (const i8*)(b + 192) + h * 8 + 2 * qq;
        const int lshift = (qq >> 1) * 4;
        const int hshift = 2 * qq;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const int q = (int)(((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32;
            v[i] = d * (float)sc[i >> 4] * (float)q;
        }
    }
};

// ---- the shared row loop ---------------------------------------------------------------------

// acc[c] += dot(row, xs[c]) for c < nc, lane's share (units lane, lane + 32, ...).
template <class D>
__device__ __forceinline__ void row_dots(const u8* row, int cols, const float* const* xs, int nc,
                                         float* acc) {
    const int lane = threadIdx.x & 31;
    const int units = (cols + 31) / 32;
    for (int u = lane; u < units; u += 32) {
        const int count = min(32, cols - u * 32);
        float w[32];
        D::decode(row, u, count, w);
#pragma unroll
        for (int c = 0; c < MM_COLS; ++c) {
            if (c < nc) {
                const float* x = xs[c] + (u64)u * 32;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    if (i < count) {
                        s = fmaf(w[i], x[i], s);
                    }
                }
                acc[c] += s;
            }
        }
    }
}

template <class D>
__device__ __forceinline__ void matmul_body(const u8* __restrict__ w, u64 row_bytes, int rows,
                                            int cols, const float* __restrict__ x, int n,
                                            float* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int b0 = blockIdx.y * MM_COLS;
    if (r >= rows || b0 >= n) {
        return;  // warp-uniform
    }
    const int nc = min(MM_COLS, n - b0);
    const float* xs[MM_COLS];
    float acc[MM_COLS];
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) {
        xs[c] = x + (u64)(b0 + min(c, nc - 1)) * cols;
        acc[c] = 0.0f;
    }
    row_dots<D>(w + (u64)r * row_bytes, cols, xs, nc, acc);
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) {
        if (c < nc) {
            const float total = warp_sum(acc[c]);
            if (lane == 0) {
                out[(u64)(b0 + c) * rows + r] = total;
            }
        }
    }
}

template <class D>
__device__ __forceinline__ void matmul_ids_body(const u8* __restrict__ w, u64 row_bytes,
                                                u64 matrix_bytes, int rows, int cols,
                                                const int* __restrict__ ids,
                                                const float* __restrict__ x, int x_div,
                                                float* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    if (r >= rows) {
        return;
    }
    const u8* matrix = w + (u64)ids[p] * matrix_bytes;
    const float* xs[MM_COLS];
    float acc[MM_COLS];
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) {
        xs[c] = x + (u64)(p / x_div) * cols;
        acc[c] = 0.0f;
    }
    row_dots<D>(matrix + (u64)r * row_bytes, cols, xs, 1, acc);
    const float total = warp_sum(acc[0]);
    if (lane == 0) {
        out[(u64)p * rows + r] = total;
    }
}

#define DEFINE_MATMUL(NAME, DEC)                                                                \
    extern "C" __global__ void matmul_##NAME(const u8* __restrict__ w, u64 row_bytes, int rows, \
                                             int cols, const float* __restrict__ x, int n,      \
                                             float* __restrict__ out) {                         \
        matmul_body<DEC>(w, row_bytes, rows, cols, x, n, out);                                  \
    }                                                                                           \
    extern "C" __global__ void matmul_ids_##NAME(                                               \
        const u8* __restrict__ w, u64 row_bytes, u64 matrix_bytes, int rows, int cols,          \
        const int* __restrict__ ids, const float* __restrict__ x, int x_div,                    \
        float* __restrict__ out) {                                                              \
        matmul_ids_body<DEC>(w, row_bytes, matrix_bytes, rows, cols, ids, x, x_div, out);       \
    }

DEFINE_MATMUL(f32, DecF32)
DEFINE_MATMUL(f16, DecF16)
DEFINE_MATMUL(bf16, DecBF16)
DEFINE_MATMUL(q4_0, DecQ40)
DEFINE_MATMUL(q4_k, DecQ4K)
DEFINE_MATMUL(q5_k, DecQ5K)
DEFINE_MATMUL(q6_k, DecQ6K)

// ---- Q8_0 -------------------------------------------------------------------------------------

// Quantises activation rows to Q8_0 as the CPU backend does (ggml's quantize_row_q8_0_ref):
// per block of 32 values d = amax / 127, q = round(x / d) (ties away from zero) with the
// unrounded d, and d kept as f16. Writes the quants to `q` (n_values bytes, row-major like x)
// and each block's f16-rounded d as f32 to `d` (n_values / 32). n_values is a multiple of 32.
// Launch: blockDim = 128 (4 warps, one block of 32 values per warp), grid = ceil(blocks / 4).
extern "C" __global__ void quantize_q8_0(const float* __restrict__ x, u64 n_blocks,
                                         i8* __restrict__ q, float* __restrict__ d) {
    const u64 block = (u64)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (block >= n_blocks) {
        return;
    }
    const float v = x[block * 32 + lane];
    float amax = fabsf(v);
    for (int offset = 16; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float scale = amax / 127.0f;
    const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    float r = roundf(v * inverse);
    r = fminf(fmaxf(r, -128.0f), 127.0f);
    q[block * 32 + lane] = (i8)(int)r;
    if (lane == 0) {
        d[block] = f16_to_f32(f32_to_f16(scale));
    }
}

// acc[c] += dot(Q8_0 row, quantised activation c), lane's share of the blocks.
__device__ __forceinline__ void row_dots_q8_0(const u8* row, int cols, const i8* const* xq,
                                              const float* const* xd, int nc, float* acc) {
    const int lane = threadIdx.x & 31;
    const int units = cols / 32;
    for (int u = lane; u < units; u += 32) {
        const u8* b = row + (u64)u * 34;
        const float dw = f16_to_f32(load_u16(b));
        const i8* qw = (const i8*)(b + 2);
        int w[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            w[i] = (int)qw[i];
        }
#pragma unroll
        for (int c = 0; c < MM_COLS; ++c) {
            if (c < nc) {
                const i8* qx = xq[c] + (u64)u * 32;
                int isum = 0;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    isum += w[i] * (int)qx[i];
                }
                acc[c] += (float)isum * (dw * xd[c][u]);
            }
        }
    }
}

// matmul for Q8_0 weights: activations given as quantize_q8_0 output (quants xq, scales xd).
// Launch shape as the other matmul kernels.
extern "C" __global__ void matmul_q8_0(const u8* __restrict__ w, u64 row_bytes, int rows,
                                       int cols, const i8* __restrict__ xq,
                                       const float* __restrict__ xd, int n,
                                       float* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int b0 = blockIdx.y * MM_COLS;
    if (r >= rows || b0 >= n) {
        return;
    }
    const int nc = min(MM_COLS, n - b0);
    const int units = cols / 32;
    const i8* qs[MM_COLS];
    const float* ds[MM_COLS];
    float acc[MM_COLS];
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) {
        const u64 b = (u64)(b0 + min(c, nc - 1));
        qs[c] = xq + b * cols;
        ds[c] = xd + b * units;
        acc[c] = 0.0f;
    }
    row_dots_q8_0(w + (u64)r * row_bytes, cols, qs, ds, nc, acc);
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) {
        if (c < nc) {
            const float total = warp_sum(acc[c]);
            if (lane == 0) {
                out[(u64)(b0 + c) * rows + r] = total;
            }
        }
    }
}

// matmul_ids for Q8_0 weights (see the top of the file); activations quantised.
extern "C" __global__ void matmul_ids_q8_0(const u8* __restrict__ w, u64 row_bytes,
                                           u64 matrix_bytes, int rows, int cols,
                                           const int* __restrict__ ids,
                                           const i8* __restrict__ xq,
                                           const float* __restrict__ xd, int x_div,
                                           float* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    if (r >= rows) {
        return;
    }
    const int units = cols / 32;
    const u64 b = (u64)(p / x_div);
    const i8* qs[MM_COLS];
    const float* ds[MM_COLS];
    float acc[MM_COLS];
#pragma unroll
    for (int c = 0; c < MM_COLS; ++c) {
        qs[c] = xq + b * cols;
        ds[c] = xd + b * units;
        acc[c] = 0.0f;
    }
    const u8* matrix = w + (u64)ids[p] * matrix_bytes;
    row_dots_q8_0(matrix + (u64)r * row_bytes, cols, qs, ds, 1, acc);
    const float total = warp_sum(acc[0]);
    if (lane == 0) {
        out[(u64)p * rows + r] = total;
    }
}
