// Quantised mat-vec and small-batch mat-mul: out[b][r] = dot(weight row r, activation row b).
//
// Weights stay in their GGUF encoding (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) exactly as
// they are in the file. A row is walked in *units* of 32 values (one Q8_0 / Q4_0 block, one
// 32-value sub-block of a K-quant super-block, 32 floats): lane `l` of the warp that owns
// weight row `r` decodes units l, l + 32, l + 64, ... once, into registers, and multiplies each
// decoded unit with the same 32 values of every activation row of its block (up to MM_COLS
// rows) before moving on. So a launch with k <= MM_COLS activation rows reads every weight
// byte once for all k rows.
//
// The per-row arithmetic does not depend on how many activation rows share the launch: lane
// sums are accumulated unit by unit in a fixed order, then reduced by the fixed butterfly of
// `warp_sum`. Row b of a k-row launch is therefore bit-identical to a one-row launch with that
// activation row (the verify / single-token parity the speculative loop relies on).
//
// F32, F16 and BF16 weights multiply f32 activations. The quantised types multiply quantised
// activations, as the CPU backend and ggml do — Q8_0 activations for Q8_0 and Q4_0 weights,
// Q8_K for the K-quants, quantised by the same rules as the CPU's, bit for bit — in exact
// integer dot products per unit (see "quantised weights" below). So the GPU's logits follow
// cpu-simd's on the same model up to the order of f32 sums.
//
// Launch shape of every `matmul_*` kernel (the quantised ones take the activation rows as
// quantize_q8_0 / quantize_q8_k outputs instead of f32): blockDim = (32 * MM_WARPS), grid =
// (ceil(rows / MM_WARPS), ceil(n / MM_COLS)). Block (x, y) computes weight rows
// x*MM_WARPS .. x*MM_WARPS+3 (one per warp) for activation rows y*MM_COLS .. y*MM_COLS+7.
// `matvec_*`, `matmul2_*` and `matmul4_*` take the same arguments with 1, 2 and 4 activation
// rows per block (grid.y = ceil(n / 1, 2 or 4); the plugin launches the narrowest that holds
// all n rows, `matmul_*` past 4): their rows are bit-identical to matmul_*'s, and they keep
// fewer registers live, so more warps hide the loads' latency (a plain decoding step has one
// row, a verify pass a few). The quantised kernels of several rows stage the activation rows
// in shared memory a tile at a time (see matmul_quant_staged): the block's four warps read
// them once, and a warp no longer holds every row's quants in registers (on sm_90 the 4- and
// 8-row Q4_K kernels fell from 78 and 112 registers a thread to 38 and 40).
//
// `matmul_ids_*` (mixture-of-experts): the weight tensor is a stack of matrices of
// `matrix_bytes` bytes; pair p (blockIdx.y) uses matrix ids[p] and activation row p / x_div,
// and writes output row p. Launch shape: blockDim = (32 * MM_WARPS), grid =
// (ceil(rows / MM_WARPS), pairs).

#define MM_WARPS 4
#define MM_COLS 8
// The quantised kernels of several rows must fit 12 blocks an SM (a cap of 40 registers a
// thread on sm_90): the 1,536 blocks of a 6144-row matrix then run in one wave on an H200's 132
// SMs. The one-row kernels are left to the compiler (a bound makes it spend more registers).
#define MM_BOUNDS_MANY __launch_bounds__(32 * MM_WARPS, 12)
#define MM_BOUNDS_ONE

// ---- float weights: the 32 values of unit `u` of a row (values u*32 .. u*32 + 31) ----------

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

// ---- the shared row loop ---------------------------------------------------------------------

// acc[c] += dot(row, activation row c) for c < nc <= COLS (row c at x + c * cols), lane's
// share (units lane, lane + 32, ...).
template <class D, int COLS>
__device__ __forceinline__ void row_dots(const u8* row, int cols, const float* x, int nc,
                                         float* acc) {
    const int lane = threadIdx.x & 31;
    const int units = (cols + 31) / 32;
    for (int u = lane; u < units; u += 32) {
        const int count = min(32, cols - u * 32);
        float w[32];
        D::decode(row, u, count, w);
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            if (c < nc) {
                const float* xc = x + (u64)c * cols + (u64)u * 32;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    if (i < count) {
                        s = fmaf(w[i], xc[i], s);
                    }
                }
                acc[c] += s;
            }
        }
    }
}

// Writes the warp's sums of acc[c] (c < nc) to out[(b0 + c) * rows + r].
template <int COLS>
__device__ __forceinline__ void store_rows(const float* acc, int nc, int b0, int rows, int r,
                                           float* __restrict__ out) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        if (c < nc) {
            const float total = warp_sum(acc[c]);
            if (lane == 0) {
                out[(u64)(b0 + c) * rows + r] = total;
            }
        }
    }
}

template <class D, int COLS>
__device__ __forceinline__ void matmul_body(const u8* __restrict__ w, u64 row_bytes, int rows,
                                            int cols, const float* __restrict__ x, int n,
                                            float* __restrict__ out) {
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int b0 = blockIdx.y * COLS;
    if (r >= rows || b0 >= n) {
        return;  // warp-uniform
    }
    const int nc = min(COLS, n - b0);
    float acc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        acc[c] = 0.0f;
    }
    row_dots<D, COLS>(w + (u64)r * row_bytes, cols, x + (u64)b0 * cols, nc, acc);
    store_rows<COLS>(acc, nc, b0, rows, r, out);
}

template <class D>
__device__ __forceinline__ void matmul_ids_body(const u8* __restrict__ w, u64 row_bytes,
                                                u64 matrix_bytes, int rows, int cols,
                                                const int* __restrict__ ids,
                                                const float* __restrict__ x, int x_div,
                                                float* __restrict__ out) {
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    if (r >= rows) {
        return;
    }
    const u8* matrix = w + (u64)ids[p] * matrix_bytes;
    float acc[1] = {0.0f};
    row_dots<D, 1>(matrix + (u64)r * row_bytes, cols, x + (u64)(p / x_div) * cols, 1, acc);
    store_rows<1>(acc, 1, p, rows, r, out);
}

// One mat-mul entry point over float weights: KERNEL_NAME with COLS activation rows a block.
#define DEFINE_MATMUL_COLS(KERNEL, NAME, DEC, COLS)                                             \
    extern "C" __global__ void KERNEL##_##NAME(const u8* __restrict__ w, u64 row_bytes,         \
                                               int rows, int cols, const float* __restrict__ x, \
                                               int n, float* __restrict__ out) {                \
        matmul_body<DEC, COLS>(w, row_bytes, rows, cols, x, n, out);                            \
    }

#define DEFINE_MATMUL(NAME, DEC)                                                                \
    DEFINE_MATMUL_COLS(matvec, NAME, DEC, 1)                                                    \
    DEFINE_MATMUL_COLS(matmul2, NAME, DEC, 2)                                                   \
    DEFINE_MATMUL_COLS(matmul4, NAME, DEC, 4)                                                   \
    DEFINE_MATMUL_COLS(matmul, NAME, DEC, MM_COLS)                                              \
    extern "C" __global__ void matmul_ids_##NAME(                                               \
        const u8* __restrict__ w, u64 row_bytes, u64 matrix_bytes, int rows, int cols,          \
        const int* __restrict__ ids, const float* __restrict__ x, int x_div,                    \
        float* __restrict__ out) {                                                              \
        matmul_ids_body<DEC>(w, row_bytes, matrix_bytes, rows, cols, ids, x, x_div, out);       \
    }

DEFINE_MATMUL(f32, DecF32)
DEFINE_MATMUL(f16, DecF16)
DEFINE_MATMUL(bf16, DecBF16)

// ---- activation quantisation ----------------------------------------------------------------

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
    const float scale = __fdiv_rn(amax, 127.0f);
    const float inverse = scale != 0.0f ? __fdiv_rn(1.0f, scale) : 0.0f;
    float r = roundf(__fmul_rn(v, inverse));
    r = fminf(fmaxf(r, -128.0f), 127.0f);
    q[block * 32 + lane] = (i8)(int)r;
    if (lane == 0) {
        d[block] = f16_to_f32(f32_to_f16(scale));
    }
}

// Quantises activation rows to Q8_K as the CPU backend does (ggml's quantize_row_q8_K_ref): per
// block of 256 values, the first value of largest magnitude `max` (sign kept; NaNs never win)
// maps to -127: iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale;
// an all-zero block gets d = 0 and zero quants. Writes the quants to `q` (row-major like x),
// d to `d` (n_values / 256) and the sum of each 32 quants to `sums` (n_values / 32).
// Launch: blockDim = 128 (4 warps, one block of 256 values per warp, 8 values per lane),
// grid = ceil(blocks / 4).
extern "C" __global__ void quantize_q8_k(const float* __restrict__ x, u64 n_blocks,
                                         i8* __restrict__ q, float* __restrict__ d,
                                         int* __restrict__ sums) {
    const u64 block = (u64)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (block >= n_blocks) {
        return;
    }
    const float* src = x + block * 256 + lane * 8;
    float v[8];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = src[i];
        amax = fmaxf(amax, fabsf(v[i]));  // fmaxf passes over NaN, as the CPU's `>` does
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    i8* dst = q + block * 256 + lane * 8;
    if (amax == 0.0f) {  // warp-uniform
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            dst[i] = 0;
        }
        if ((lane & 3) == 0) {
            sums[block * 8 + (lane >> 2)] = 0;
        }
        if (lane == 0) {
            d[block] = 0.0f;
        }
        return;
    }
    // The first index holding that magnitude, and its signed value.
    int first = 256;
    float max = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (first == 256 && fabsf(v[i]) == amax) {
            first = lane * 8 + i;
            max = v[i];
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const int other_first = __shfl_xor_sync(0xffffffffu, first, offset);
        const float other_max = __shfl_xor_sync(0xffffffffu, max, offset);
        if (other_first < first) {
            first = other_first;
            max = other_max;
        }
    }
    const float iscale = __fdiv_rn(-127.0f, max);
    int sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int level = min(127, __float2int_rn(__fmul_rn(iscale, v[i])));
        dst[i] = (i8)level;
        sum += level;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if ((lane & 3) == 0) {
        sums[block * 8 + (lane >> 2)] = sum;
    }
    if (lane == 0) {
        d[block] = __fdiv_rn(1.0f, iscale);
    }
}

// ---- quantised weights: integer dot products with quantised activations ---------------------
//
// Q8_0 and Q4_0 weights multiply Q8_0 activations; Q4_K, Q5_K and Q6_K weights multiply Q8_K
// activations (as the CPU backend and ggml do). A decoder turns unit u of a row (32 values)
// into its 32 integer weight levels, packed as 8 words of 4 signed bytes in value order, plus
// the integer scales of its two halves of 16, its integer min (Q4_K / Q5_K) and the block's
// f32 scales d and dmin. The unit's dot with 32 activation quants is then exact (dp4a), and
// becomes f32 once per unit and activation row, in this order:
//
//   t = (d_x * d) * (float)(sc_lo * dot(values 0..15) + sc_hi * dot(values 16..31))
//   t = t - (d_x * dmin) * (float)(m * sum of the unit's activation quants)   [with mins]
//   acc += t
//
// with d_x the activation block's scale (one per 32 values for Q8_0, per 256 for Q8_K). The
// float operations are written as rounding intrinsics, so the compiler cannot fuse or reorder
// them differently for different activation rows of a launch (and the emulator computes the
// same bits). The f32 result differs from the CPU kernels only in the order of the f32 sums.
//
// Memory: weight quants are read in 16-byte vector loads where the format keeps them 16-byte
// aligned (Q4_K, Q5_K) and in 16-bit loads where it does not (Q8_0, Q4_0, Q6_K); activation
// quants in 16-byte loads.

struct QuantUnit {
    u32 q[8];
    int sc_lo, sc_hi, m;
    float d, dmin;
};

// The 32 bytes at p (16-byte aligned) as 8 little-endian words, in two vector loads.
__device__ __forceinline__ void load_32(const void* p, u32* words) {
    const U32x4 lo = load_16(p);
    const U32x4 hi = load_16((const u8*)p + 16);
    words[0] = lo.x;
    words[1] = lo.y;
    words[2] = lo.z;
    words[3] = lo.w;
    words[4] = hi.x;
    words[5] = hi.y;
    words[6] = hi.z;
    words[7] = hi.w;
}

// Q8_0 block (34 bytes, 32 values): d (f16), 32 int8 quants.
struct QuantQ80 {
    static const int DX_SHIFT = 0;
    static const bool MINS = false;
    static __device__ __forceinline__ void decode(const u8* row, int u, QuantUnit* w) {
        const u8* b = row + (u64)u * 34;
        w->d = f16_to_f32(load_u16(b));
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            w->q[k] = load_u32_from_u16s(b + 2 + 4 * k);
        }
        w->sc_lo = w->sc_hi = 1;
        w->m = 0;
        w->dmin = 0.0f;
    }
};

// Q4_0 block (18 bytes, 32 values): d (f16), 16 bytes of 4-bit quants; value i is
// d * ((qs[i] & 0xF) - 8) for i < 16 and d * ((qs[i - 16] >> 4) - 8) for the upper half.
struct QuantQ40 {
    static const int DX_SHIFT = 0;
    static const bool MINS = false;
    static __device__ __forceinline__ void decode(const u8* row, int u, QuantUnit* w) {
        const u8* b = row + (u64)u * 18;
        w->d = f16_to_f32(load_u16(b));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const u32 packed = load_u32_from_u16s(b + 2 + 4 * k);
            w->q[k] = sub_bytes(packed & 0x0F0F0F0Fu, 8);
            w->q[k + 4] = sub_bytes((packed >> 4) & 0x0F0F0F0Fu, 8);
        }
        w->sc_lo = w->sc_hi = 1;
        w->m = 0;
        w->dmin = 0.0f;
    }
};

// The first 16 bytes of a Q4_K / Q5_K super-block (16-byte aligned in both formats, so one
// vector load): d (f16) and dmin (f16) in word x, then 12 bytes packing the 6-bit scales and
// mins of its 8 sub-blocks (bytes 0..3 in y, 4..7 in z, 8..11 in w). Fills sub-block j's
// integer scale and min and the f32 d and dmin.
__device__ __forceinline__ void k4_header(const u8* b, int j, QuantUnit* w) {
    const U32x4 h = load_16(b);
    const int shift = 8 * (j & 3);
    const u32 lo = (h.y >> shift) & 0xFF;   // byte j & 3
    const u32 mid = (h.z >> shift) & 0xFF;  // byte 4 + (j & 3)
    if (j < 4) {
        w->sc_lo = lo & 63;
        w->m = mid & 63;
    } else {
        const u32 hi = (h.w >> shift) & 0xFF;  // byte 8 + (j & 3)
        w->sc_lo = (hi & 0xF) | ((lo >> 6) << 4);
        w->m = (hi >> 4) | ((mid >> 6) << 4);
    }
    w->sc_hi = w->sc_lo;
    w->d = f16_to_f32((u16)(h.x & 0xFFFF));
    w->dmin = f16_to_f32((u16)(h.x >> 16));
}

// Q4_K super-block (144 bytes, 256 values): d (f16), dmin (f16), 12 bytes of packed 6-bit
// scales and mins, 128 bytes of 4-bit quants. Sub-block j uses scale/min pair j; its quants are
// the low (j even) or high (j odd) nibbles of bytes (j/2)*32 ..; value = d*sc*q - dmin*m.
struct QuantQ4K {
    static const int DX_SHIFT = 3;
    static const bool MINS = true;
    static __device__ __forceinline__ void decode(const u8* row, int u, QuantUnit* w) {
        const u8* b = row + (u64)(u >> 3) * 144;
        const int j = u & 7;
        k4_header(b, j, w);
        const int shift = (j & 1) * 4;
        u32 words[8];
        load_32(b + 16 + (j >> 1) * 32, words);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            w->q[k] = (words[k] >> shift) & 0x0F0F0F0Fu;
        }
    }
};

// Q5_K super-block (176 bytes, 256 values): d (f16), dmin (f16), 12 bytes of scales and mins
// packed as Q4_K's, qh (32 bytes, the fifth bits), qs (128 bytes, the low 4 bits). Sub-block j
// takes low bits as Q4_K does and its fifth bit from bit j of qh[i]; value = d*sc*q - dmin*m.
struct QuantQ5K {
    static const int DX_SHIFT = 3;
    static const bool MINS = true;
    static __device__ __forceinline__ void decode(const u8* row, int u, QuantUnit* w) {
        const u8* b = row + (u64)(u >> 3) * 176;
        const int j = u & 7;
        k4_header(b, j, w);
        u32 high[8], low[8];
        load_32(b + 16, high);
        load_32(b + 48 + (j >> 1) * 32, low);
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            w->q[k] = ((low[k] >> shift) & 0x0F0F0F0Fu) | (((high[k] >> j) & 0x01010101u) << 4);
        }
    }
};

// Q6_K super-block (210 bytes, 256 values): ql (128 bytes, low 4 bits), qh (64 bytes, high 2
// bits), 16 int8 scales, d (f16). Sub-block j = 4*h + qq (h = 128-value half, qq = quarter):
// low bits from ql[h*64 + (qq&1)*32 + l] (low nibble for qq < 2, high nibble otherwise), high
// bits from qh[h*32 + l] >> 2*qq, scale sc[h*8 + l/16 + 2*qq]; value = d * sc * (q - 32).
struct QuantQ6K {
    static const int DX_SHIFT = 3;
    static const bool MINS = false;
    static __device__ __forceinline__ void decode(const u8* row, int u, QuantUnit* w) {
        const u8* b = row + (u64)(u >> 3) * 210;
        const int j = u & 7;
        const int h = j >> 2;
        const int qq = j & 3;
        const u8* ql = b + h * 64 + (qq & 1) * 32;
        const u8* qh = b + 128 + h * 32;
        const int lshift = (qq >> 1) * 4;
        const int hshift = 2 * qq;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const u32 low = (load_u32_from_u16s(ql + 4 * k) >> lshift) & 0x0F0F0F0Fu;
            const u32 high = (load_u32_from_u16s(qh + 4 * k) >> hshift) & 0x03030303u;
            w->q[k] = sub_bytes(low | (high << 4), 32);
        }
        const i8* sc = (const i8*)(b + 192) + h * 8 + 2 * qq;
        w->sc_lo = sc[0];
        w->sc_hi = sc[1];
        w->m = 0;
        w->d = f16_to_f32(load_u16(b + 208));
        w->dmin = 0.0f;
    }
};

// Unit u's dot with one activation row's 32 quants `qx` (scale dx, quant sum xsum), as f32:
// the one place this arithmetic is written, so every kernel computes a unit's share alike.
template <class D>
__device__ __forceinline__ float unit_dot(const QuantUnit& w, const u32* qx, float dx,
                                          int xsum) {
    int dot_lo = 0, dot_hi = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        dot_lo = dp4a(w.q[k], qx[k], dot_lo);
        dot_hi = dp4a(w.q[k + 4], qx[k + 4], dot_hi);
    }
    const int isum = w.sc_lo * dot_lo + w.sc_hi * dot_hi;
    float t = __fmul_rn(__fmul_rn(dx, w.d), (float)isum);
    if (D::MINS) {
        t = __fmaf_rn(-__fmul_rn(dx, w.dmin), (float)(w.m * xsum), t);
    }
    return t;
}

// acc[c] += dot(row, activation row c) for c < nc <= COLS, lane's share (units lane, lane + 32,
// ...).
// Activation row c: quants xq + c * cols, scales xd + c * (cols >> (5 + DX_SHIFT)), unit sums
// xsums + c * (cols / 32).
template <class D, int COLS>
__device__ __forceinline__ void row_dots_quant(const u8* row, int cols, const i8* xq,
                                               const float* xd, const int* xsums, int nc,
                                               float* acc) {
    const int lane = threadIdx.x & 31;
    const int units = cols / 32;
    const int scales_per_row = units >> D::DX_SHIFT;
    for (int u = lane; u < units; u += 32) {
        QuantUnit w;
        D::decode(row, u, &w);
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            if (c < nc) {
                u32 qx[8];
                load_32(xq + (u64)c * cols + (u64)u * 32, qx);
                const float dx = xd[(u64)c * scales_per_row + (u >> D::DX_SHIFT)];
                acc[c] = __fadd_rn(acc[c], unit_dot<D>(w, qx, dx, xsums[(u64)c * units + u]));
            }
        }
    }
}

// Units of the activation rows a block of a multi-row kernel stages in shared memory at a time:
// 64 (2,048 values, 2 KiB of quants a row), 32 for 8 rows, so that twelve blocks' tiles fit an
// SM's shared memory. A multiple of 32, so a lane's units keep their order.
#define MM_TILE_UNITS(COLS) ((COLS) > 4 ? 32 : 64)

// The multi-row kernels (COLS > 1): the block's MM_WARPS weight rows share the same activation
// rows, so the block copies them into shared memory a tile of MM_TILE_UNITS units at a time
// (all its loads in flight together, once for the block), then each warp runs its row's units
// of the tile against the staged rows. A lane still takes units lane, lane + 32, ... in that
// order and each unit through unit_dot, so the sums are row_dots_quant's, bit for bit.
template <class D, int COLS>
__device__ __forceinline__ void matmul_quant_staged(const u8* __restrict__ w, u64 row_bytes,
                                                    int rows, int cols,
                                                    const i8* __restrict__ xq,
                                                    const float* __restrict__ xd,
                                                    const int* __restrict__ xsums, int nc,
                                                    int r, int b0, float* __restrict__ out) {
    constexpr int TILE = MM_TILE_UNITS(COLS);
    // Activation scales: one a unit (Q8_0, Q4_0) or one per 8 (Q8_K); unit sums for the mins.
    constexpr int SCALES = TILE >> D::DX_SHIFT;
    constexpr int SUMS = D::MINS ? TILE : 1;
    // A unit's 32 quant bytes as two 16-byte halves, each half in its own run of the tile
    // (lanes read consecutive words: no bank conflicts), runs 2c and 2c + 1 for row c.
    __shared__ U32x4 staged_q[COLS * 2 * TILE];
    __shared__ float staged_d[COLS * SCALES];
    __shared__ int staged_sums[COLS * SUMS];
    const int lane = threadIdx.x & 31;
    const int units = cols / 32;
    const int scales_per_row = units >> D::DX_SHIFT;
    // A warp past the matrix's last row still stages and meets every barrier.
    const bool active = r < rows;
    const u8* row = w + (u64)r * row_bytes;
    float acc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        acc[c] = 0.0f;
    }
    for (int first = 0; first < units; first += TILE) {
        const int tile = min(TILE, units - first);
        const int groups = tile >> D::DX_SHIFT;
        for (int c = 0; c < nc; ++c) {
            const i8* quants = xq + (u64)(b0 + c) * cols + (u64)first * 32;
            for (int part = threadIdx.x; part < tile * 2; part += blockDim.x) {
                staged_q[(2 * c + (part & 1)) * TILE + (part >> 1)] =
                    load_16(quants + (u64)part * 16);
            }
            if (D::MINS) {
                for (int u = threadIdx.x; u < tile; u += blockDim.x) {
                    staged_sums[c * SUMS + u] =
                        xsums[(u64)(b0 + c) * units + first + u];
                }
            }
            for (int g = threadIdx.x; g < groups; g += blockDim.x) {
                staged_d[c * SCALES + g] =
                    xd[(u64)(b0 + c) * scales_per_row + (first >> D::DX_SHIFT) + g];
            }
        }
        __syncthreads();
        if (active) {
            for (int u = first + lane; u < first + tile; u += 32) {
                QuantUnit wu;
                D::decode(row, u, &wu);
                const int t = u - first;
#pragma unroll
                for (int c = 0; c < COLS; ++c) {
                    if (c < nc) {
                        const U32x4 lo = staged_q[2 * c * TILE + t];
                        const U32x4 hi = staged_q[(2 * c + 1) * TILE + t];
                        const u32 qx[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
                        const float dx = staged_d[c * SCALES + (t >> D::DX_SHIFT)];
                        acc[c] = __fadd_rn(
                            acc[c],
                            unit_dot<D>(wu, qx, dx,
                                        D::MINS ? staged_sums[c * SUMS + t] : 0));
                    }
                }
            }
        }
        __syncthreads();
    }
    if (active) {
        store_rows<COLS>(acc, nc, b0, rows, r, out);
    }
}

// A block's rows of a quantised mat-mul: the staged tiles for several activation rows, the
// direct loads for one (a single row has nothing for the block's warps to share).
template <class D, int COLS>
struct MatmulQuant {
    static __device__ __forceinline__ void run(const u8* __restrict__ w, u64 row_bytes, int rows,
                                               int cols, const i8* __restrict__ xq,
                                               const float* __restrict__ xd,
                                               const int* __restrict__ xsums, int nc, int r,
                                               int b0, float* __restrict__ out) {
        matmul_quant_staged<D, COLS>(w, row_bytes, rows, cols, xq, xd, xsums, nc, r, b0, out);
    }
};
template <class D>
struct MatmulQuant<D, 1> {
    static __device__ __forceinline__ void run(const u8* __restrict__ w, u64 row_bytes, int rows,
                                               int cols, const i8* __restrict__ xq,
                                               const float* __restrict__ xd,
                                               const int* __restrict__ xsums, int nc, int r,
                                               int b0, float* __restrict__ out) {
        if (r >= rows) {
            return;  // warp-uniform
        }
        const int units = cols / 32;
        float acc[1] = {0.0f};
        row_dots_quant<D, 1>(w + (u64)r * row_bytes, cols, xq + (u64)b0 * cols,
                             xd + (u64)b0 * (units >> D::DX_SHIFT), xsums + (u64)b0 * units, 1,
                             acc);
        store_rows<1>(acc, 1, b0, rows, r, out);
    }
};

template <class D, int COLS>
__device__ __forceinline__ void matmul_quant_body(const u8* __restrict__ w, u64 row_bytes,
                                                  int rows, int cols, const i8* __restrict__ xq,
                                                  const float* __restrict__ xd,
                                                  const int* __restrict__ xsums, int n,
                                                  float* __restrict__ out) {
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int b0 = blockIdx.y * COLS;
    if (b0 >= n) {
        return;  // block-uniform
    }
    MatmulQuant<D, COLS>::run(w, row_bytes, rows, cols, xq, xd, xsums, min(COLS, n - b0), r, b0,
                              out);
}

template <class D>
__device__ __forceinline__ void matmul_ids_quant_body(const u8* __restrict__ w, u64 row_bytes,
                                                      u64 matrix_bytes, int rows, int cols,
                                                      const int* __restrict__ ids,
                                                      const i8* __restrict__ xq,
                                                      const float* __restrict__ xd,
                                                      const int* __restrict__ xsums, int x_div,
                                                      float* __restrict__ out) {
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int p = blockIdx.y;
    if (r >= rows) {
        return;
    }
    const int units = cols / 32;
    const u64 b = (u64)(p / x_div);
    float acc[1] = {0.0f};
    const u8* matrix = w + (u64)ids[p] * matrix_bytes;
    row_dots_quant<D, 1>(matrix + (u64)r * row_bytes, cols, xq + b * cols,
                         xd + b * (units >> D::DX_SHIFT), xsums + b * units, 1, acc);
    store_rows<1>(acc, 1, p, rows, r, out);
}

// One mat-mul entry point over quantised weights: KERNEL_NAME with COLS activation rows a
// block.
#define DEFINE_MATMUL_QUANT_COLS(KERNEL, NAME, DEC, COLS, BOUNDS)                               \
    extern "C" __global__ void BOUNDS KERNEL##_##NAME(                                          \
        const u8* __restrict__ w, u64 row_bytes, int rows, int cols, const i8* __restrict__ xq, \
        const float* __restrict__ xd, const int* __restrict__ xsums, int n,                     \
        float* __restrict__ out) {                                                              \
        matmul_quant_body<DEC, COLS>(w, row_bytes, rows, cols, xq, xd, xsums, n, out);          \
    }

#define DEFINE_MATMUL_QUANT(NAME, DEC)                                                          \
    DEFINE_MATMUL_QUANT_COLS(matvec, NAME, DEC, 1, MM_BOUNDS_ONE)                               \
    DEFINE_MATMUL_QUANT_COLS(matmul2, NAME, DEC, 2, MM_BOUNDS_MANY)                             \
    DEFINE_MATMUL_QUANT_COLS(matmul4, NAME, DEC, 4, MM_BOUNDS_MANY)                             \
    DEFINE_MATMUL_QUANT_COLS(matmul, NAME, DEC, MM_COLS, MM_BOUNDS_MANY)                        \
    extern "C" __global__ void matmul_ids_##NAME(                                               \
        const u8* __restrict__ w, u64 row_bytes, u64 matrix_bytes, int rows, int cols,          \
        const int* __restrict__ ids, const i8* __restrict__ xq, const float* __restrict__ xd,   \
        const int* __restrict__ xsums, int x_div, float* __restrict__ out) {                    \
        matmul_ids_quant_body<DEC>(w, row_bytes, matrix_bytes, rows, cols, ids, xq, xd, xsums,  \
                                   x_div, out);                                                 \
    }

DEFINE_MATMUL_QUANT(q8_0, QuantQ80)
DEFINE_MATMUL_QUANT(q4_0, QuantQ40)
DEFINE_MATMUL_QUANT(q4_k, QuantQ4K)
DEFINE_MATMUL_QUANT(q5_k, QuantQ5K)
DEFINE_MATMUL_QUANT(q6_k, QuantQ6K)
