// Grouped-query softmax attention of 1..k query rows over the KV cache, with the optional
// sigmoid output gate of the gated (qwen35 / qwen3next / MTP) attention block.
//
// The launch's rows may belong to different sequences: row r's ROW_INFO ints at row_info +
// ROW_INFO * r are its sequence slot s, its position p, where its tree path starts in `paths`
// (-1 for a chain row), its tree's first position (and its RoPE position, for rope.cu). A chain row attends to cache positions
// 0 ..= p of its sequence. The cache is paged in blocks of KV_BLOCK positions: position j of
// sequence s is cache row slot(j) = table[j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK, table =
// tables + s * table_stride (the sequence's block table; an unpaged cache passes an identity
// table and table_stride 0), its keys at k_cache + slot(j) * n_head_kv * head_dim, its values
// at v_cache + slot(j) * n_head_kv * value_dim (in values; for Q8_0 in head rows of
// dim / 32 * 34 bytes, see kv_row), stored as f32 (`attention`), as IEEE
// binary16 bits (`attention_f16`, the `kv_type = "f16"` cache; each value widened to f32
// exactly before use, as the CPU backend does) or as ggml's Q8_0 blocks (`attention_q8_0`, the
// `kv_type = "q8_0"` cache: each head row dim / 32 blocks of an f16 scale and 32 signed bytes;
// a cache row n_head_kv such head rows). With a Q8_0 cache the query is quantised to Q8_0 as
// the CPU backend quantises it and a score is its integer dot products, block by block
// (`fma(isum_b, d_k * d_q, acc)` in block order: cpu-simd's arithmetic where it scores a
// Q8_0 cache as integers, at AVX-512); values are widened (`q * d`) before use.
// Query head h reads key/value head h / (n_head / n_head_kv) (ggml's broadcast). As the CPU
// backend: scores q.k * scale in position order, softmax as exp(s - max) with the sum in f64
// scaled by the f32 reciprocal, then the value rows accumulated in position order. With
// `gate`, the output is multiplied by sigmoid(gate[r * gate_row_stride + h * gate_head_stride
// + d]). The output row is n_head * value_dim values at out + r * n_head * value_dim.
//
// Each (row, head) is computed by one block in a fixed order that depends only on the number
// of keys, so a verify row equals a single-token evaluation at the same position, whatever
// other rows and sequences share the launch.
//
// `scores` is scratch of at least rows * n_head * score_stride floats (score_stride >= the
// largest key count).
//
// Tree rows (tree speculation; path start >= 0): row r sees the positions before its tree's
// first position b and then its path: paths[start] = the path's length L, paths[start + 1 + k]
// = the cache position of its k-th node (the row's own last). Key j < b is position j, key
// b + k the k-th node's: the same keys, in the same order, as the path evaluated alone as
// consecutive positions, so the row gets that evaluation's bits.
//
// Launch (the attention kernels after attend_row): grid = (n_head, rows), blockDim = 128. Thread t
// scores keys t, t + 128, ... and accumulates output dimensions t, t + 128, ...

// Positions per block of a paged cache (the engine's BLOCK_TOKENS).
#define KV_BLOCK 64

// The cache row of position j.
__device__ __forceinline__ u64 kv_slot(const u32* __restrict__ table, int j) {
    return (u64)table[j / KV_BLOCK] * KV_BLOCK + (u64)(j % KV_BLOCK);
}

// Bytes of a Q8_0 head row of `dim` values.
__device__ __forceinline__ u64 q8_row_bytes(int dim) {
    return (u64)(dim / 32) * 34;
}

// Head `head`'s row of `dim` values in cache row `slot` (n_head_kv heads per cache row).
__device__ __forceinline__ const float* kv_row(const float* c, u64 slot, int head,
                                               int n_head_kv, int dim) {
    return c + (slot * n_head_kv + head) * dim;
}
__device__ __forceinline__ const u16* kv_row(const u16* c, u64 slot, int head, int n_head_kv,
                                             int dim) {
    return c + (slot * n_head_kv + head) * dim;
}
__device__ __forceinline__ const u8* kv_row(const u8* c, u64 slot, int head, int n_head_kv,
                                            int dim) {
    return c + (slot * n_head_kv + head) * q8_row_bytes(dim);
}

// Value `i` of a cache row as f32.
__device__ __forceinline__ float kv_value(const float* row, u64 i) {
    return row[i];
}
__device__ __forceinline__ float kv_value(const u16* row, u64 i) {
    return f16_to_f32(row[i]);
}
__device__ __forceinline__ float kv_value(const u8* row, u64 i) {
    const u8* block = row + (i / 32) * 34;
    return (float)(i8)block[2 + i % 32] * f16_to_f32(load_u16(block));
}

// A Q8_0 quant: `x` (a value times its block's 1 / d, at most 127.5 in magnitude) rounded to
// nearest, ties away from zero (C's roundf, the CPU's round_half_away); a NaN or an infinite
// `x` (a block too small for 1 / d to be finite) is 0, as the CPU quantiser's cast makes it.
__device__ __forceinline__ i8 q8_quant(float x) {
    return fabsf(x) < 256.0f ? (i8)(int)roundf(x) : (i8)0;
}

// Quantises the query `qh` (head_dim values in shared memory) to Q8_0 for a Q8_0 cache, as
// the CPU backend does (ggml's quantiser: per 32 values d = amax / 127, quants round(v / d)
// ties away from zero, d kept as f16): quants into `qq`, each block's widened scale into
// `qd`. Nothing for the float caches. Ends with __syncthreads.
template <typename Kv>
__device__ __forceinline__ void quantize_query(const float* qh, i8* qq, float* qd,
                                               int head_dim) {
}
template <>
__device__ __forceinline__ void quantize_query<u8>(const float* qh, i8* qq, float* qd,
                                                   int head_dim) {
    for (int b = threadIdx.x; b < head_dim / 32; b += blockDim.x) {
        const float* v = qh + 32 * b;
        float amax = 0.0f;
        for (int t = 0; t < 32; ++t) {
            amax = amax > fabsf(v[t]) ? amax : fabsf(v[t]);
        }
        const float d = amax / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        for (int t = 0; t < 32; ++t) {
            qq[32 * b + t] = q8_quant(v[t] * inverse);
        }
        qd[b] = f16_to_f32(f32_to_f16(d));
    }
    __syncthreads();
}

// The query's dot product with a key row (before the scale): f32 multiply-adds in dimension
// order over a float cache; over a Q8_0 cache the quantised query's integer dot products.
// Where the row's values fill 16-byte words (head_dim a multiple of 4 f32 or 8 f16 values:
// the row then starts 16-byte aligned too), it is read a word at a time, four words in flight
// together; the multiply-adds keep their order either way.
__device__ __forceinline__ float key_dot(const float* qh, const i8* qq, const float* qd,
                                         const float* kj, int head_dim) {
    float s = 0.0f;
    if (head_dim % 4 == 0) {
#pragma unroll 4
        for (int w = 0; w < head_dim / 4; ++w) {
            const U32x4 v = load_16(kj + 4 * w);
            s = fmaf(qh[4 * w], __uint_as_float(v.x), s);
            s = fmaf(qh[4 * w + 1], __uint_as_float(v.y), s);
            s = fmaf(qh[4 * w + 2], __uint_as_float(v.z), s);
            s = fmaf(qh[4 * w + 3], __uint_as_float(v.w), s);
        }
        return s;
    }
#pragma unroll 8
    for (int d = 0; d < head_dim; ++d) {
        s = fmaf(qh[d], kj[d], s);
    }
    return s;
}
// s + the dot of the two f16 values in `pair` (the lower first) with q[0], q[1].
__device__ __forceinline__ float fma_f16_pair(const float* q, u32 pair, float s) {
    s = fmaf(q[0], f16_to_f32((u16)(pair & 0xFFFF)), s);
    return fmaf(q[1], f16_to_f32((u16)(pair >> 16)), s);
}
__device__ __forceinline__ float key_dot(const float* qh, const i8* qq, const float* qd,
                                         const u16* kj, int head_dim) {
    float s = 0.0f;
    if (head_dim % 8 == 0) {
#pragma unroll 4
        for (int w = 0; w < head_dim / 8; ++w) {
            const U32x4 v = load_16(kj + 8 * w);
            s = fma_f16_pair(qh + 8 * w, v.x, s);
            s = fma_f16_pair(qh + 8 * w + 2, v.y, s);
            s = fma_f16_pair(qh + 8 * w + 4, v.z, s);
            s = fma_f16_pair(qh + 8 * w + 6, v.w, s);
        }
        return s;
    }
#pragma unroll 8
    for (int d = 0; d < head_dim; ++d) {
        s = fmaf(qh[d], f16_to_f32(kj[d]), s);
    }
    return s;
}
__device__ __forceinline__ float key_dot(const float* qh, const i8* qq, const float* qd,
                                         const u8* kj, int head_dim) {
    float s = 0.0f;
    for (int b = 0; b < head_dim / 32; ++b) {
        const u8* block = kj + 34 * b;
        int isum = 0;
#pragma unroll 8
        for (int t = 0; t < 32; ++t) {
            isum += (int)(i8)block[2 + t] * (int)qq[32 * b + t];
        }
        s = fmaf((float)isum, f16_to_f32(load_u16(block)) * qd[b], s);
    }
    return s;
}

// `acc` times sigmoid(gate) for output dimension d of row r, head h (`acc` without a gate).
__device__ __forceinline__ float gated(float acc, const float* __restrict__ gate, int r,
                                       u64 gate_row_stride, int h, int gate_head_stride, int d) {
    if (gate != 0) {
        acc *= sigmoid_f(gate[(u64)r * gate_row_stride + (u64)h * gate_head_stride + d]);
    }
    return acc;
}

// The block's work for query row blockIdx.y, head blockIdx.x; the shared arrays are the
// kernel's (red: 1024 doubles, redf and qh: 1024 floats).
template <typename Kv>
__device__ __forceinline__ void attend_row(const float* __restrict__ q, u64 q_row_stride,
                                           int q_head_stride, const u32* __restrict__ tables,
                                           u64 table_stride, const int* __restrict__ row_info,
                                           const int* __restrict__ paths,
                                           const Kv* __restrict__ k_cache,
                                           const Kv* __restrict__ v_cache, int n_head,
                                           int n_head_kv, int head_dim, int value_dim,
                                           float scale, float* __restrict__ scores,
                                           u64 score_stride, const float* __restrict__ gate,
                                           u64 gate_row_stride, int gate_head_stride,
                                           float* __restrict__ out, double* red, float* redf,
                                           float* qh, i8* qq, float* qd) {
    const int h = blockIdx.x;
    const int r = blockIdx.y;
    const int tid = threadIdx.x;
    const int* info = row_info + (u64)r * ROW_INFO;
    const u32* table = tables + (u64)info[0] * table_stride;
    const int* path = info[2] >= 0 ? paths + info[2] : 0;
    const int tree_base = info[3];
    const int n_keys = path != 0 ? tree_base + path[0] : info[1] + 1;
    const int kv_head = h / (n_head / n_head_kv);
    const float* qs = q + (u64)r * q_row_stride + (u64)h * q_head_stride;
    for (int d = tid; d < head_dim; d += blockDim.x) {
        qh[d] = qs[d];
    }
    __syncthreads();
    quantize_query<Kv>(qh, qq, qd, head_dim);

    float* sc = scores + ((u64)r * n_head + h) * score_stride;
    float local_max = __int_as_float(0xff800000);  // -inf
    for (int j = tid; j < n_keys; j += blockDim.x) {
        const int pj = (path != 0 && j >= tree_base) ? path[1 + j - tree_base] : j;
        const Kv* kj = kv_row(k_cache, kv_slot(table, pj), kv_head, n_head_kv, head_dim);
        float s = key_dot(qh, qq, qd, kj, head_dim);
        s *= scale;
        sc[j] = s;
        local_max = fmaxf(local_max, s);
    }
    const float max = block_max_f32(local_max, redf);
    double local_sum = 0.0;
    for (int j = tid; j < n_keys; j += blockDim.x) {
        const float e = expf(sc[j] - max);
        sc[j] = e;
        local_sum += (double)e;
    }
    const double sum = block_sum_f64(local_sum, red);
    const float inverse = (float)(1.0 / sum);
    // block_sum_f64 ends with __syncthreads: every score written above is visible.

    // A thread's output dimensions d and d + blockDim.x (value_dim up to twice the block) in
    // one walk over the keys, so the second does not wait for the first's loads; each keeps
    // its own multiply-adds in position order.
    float* o = out + (u64)r * n_head * value_dim + (u64)h * value_dim;
    for (int d = tid; d < value_dim; d += 2 * blockDim.x) {
        const int d2 = d + blockDim.x;
        const bool second = d2 < value_dim;
        float acc = 0.0f, acc2 = 0.0f;
#pragma unroll 8
        for (int j = 0; j < n_keys; ++j) {
            const int pj = (path != 0 && j >= tree_base) ? path[1 + j - tree_base] : j;
            const Kv* vj = kv_row(v_cache, kv_slot(table, pj), kv_head, n_head_kv, value_dim);
            const float weight = sc[j] * inverse;
            acc = fmaf(weight, kv_value(vj, d), acc);
            if (second) {
                acc2 = fmaf(weight, kv_value(vj, d2), acc2);
            }
        }
        o[d] = gated(acc, gate, r, gate_row_stride, h, gate_head_stride, d);
        if (second) {
            o[d2] = gated(acc2, gate, r, gate_row_stride, h, gate_head_stride, d2);
        }
    }
}

// One attention kernel per cache type: `NAME` over caches of `Kv` (the shared arrays of
// attend_row; qq and qd hold a Q8_0 cache's quantised query and go unused otherwise).
#define DEFINE_ATTENTION(NAME, Kv)                                                                \
    extern "C" __global__ void NAME(                                                              \
        const float* __restrict__ q, u64 q_row_stride, int q_head_stride,                         \
        const u32* __restrict__ tables, u64 table_stride, const int* __restrict__ row_info,       \
        const int* __restrict__ paths, const Kv* __restrict__ k_cache,                            \
        const Kv* __restrict__ v_cache, int n_head, int n_head_kv, int head_dim, int value_dim,   \
        float scale, float* __restrict__ scores, u64 score_stride,                                \
        const float* __restrict__ gate, u64 gate_row_stride, int gate_head_stride,                \
        float* __restrict__ out) {                                                                \
        __shared__ double red[1024];                                                              \
        __shared__ float redf[1024];                                                              \
        __shared__ float qh[1024];                                                                \
        __shared__ i8 qq[1024];                                                                   \
        __shared__ float qd[32];                                                                  \
        attend_row<Kv>(q, q_row_stride, q_head_stride, tables, table_stride, row_info, paths,     \
                       k_cache, v_cache, n_head, n_head_kv, head_dim, value_dim, scale, scores,   \
                       score_stride, gate, gate_row_stride, gate_head_stride, out, red, redf, qh, \
                       qq, qd);                                                                   \
    }

DEFINE_ATTENTION(attention, float)
DEFINE_ATTENTION(attention_f16, u16)
DEFINE_ATTENTION(attention_q8_0, u8)

// Stores rows * width f32 values of src (row r: the keys or values of the launch's row r)
// into the cache row of row r's position in its sequence (row_info and the tables as the
// attention kernels'; see kv_slot) at dst, as f32 (`kv_store`) or as binary16 bits rounded to
// nearest-even (`kv_store_f16`). Launch: blockDim = 256, grid = ceil(rows * width / 256);
// thread i handles value i. `kv_store_q8_0` stores Q8_0 blocks (the CPU backend's quantiser:
// ggml's), one thread per 32-value block: grid = ceil(rows * width / 32 / 256).
__device__ __forceinline__ u64 kv_store_at(const int* __restrict__ row_info,
                                           const u32* __restrict__ tables, u64 table_stride,
                                           u64 i, u64 width) {
    const int* info = row_info + (i / width) * ROW_INFO;
    return kv_slot(tables + (u64)info[0] * table_stride, info[1]) * width + i % width;
}
extern "C" __global__ void kv_store(const float* __restrict__ src, u64 rows, u64 width,
                                    const int* __restrict__ row_info,
                                    const u32* __restrict__ tables, u64 table_stride,
                                    float* __restrict__ dst) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * width) {
        dst[kv_store_at(row_info, tables, table_stride, i, width)] = src[i];
    }
}
extern "C" __global__ void kv_store_f16(const float* __restrict__ src, u64 rows, u64 width,
                                        const int* __restrict__ row_info,
                                        const u32* __restrict__ tables, u64 table_stride,
                                        u16* __restrict__ dst) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * width) {
        dst[kv_store_at(row_info, tables, table_stride, i, width)] = f32_to_f16(src[i]);
    }
}
extern "C" __global__ void kv_store_q8_0(const float* __restrict__ src, u64 rows, u64 width,
                                         const int* __restrict__ row_info,
                                         const u32* __restrict__ tables, u64 table_stride,
                                         u8* __restrict__ dst) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 per_row = width / 32;
    if (i < rows * per_row) {
        const u64 row = i / per_row;
        const int* info = row_info + row * ROW_INFO;
        const u64 slot = kv_slot(tables + (u64)info[0] * table_stride, info[1]);
        const float* v = src + row * width + (i % per_row) * 32;
        u8* block = dst + (slot * per_row + i % per_row) * 34;
        // ggml's quantiser, with the CPU backend's comparisons (NaNs land as they do there).
        float amax = 0.0f;
        for (int t = 0; t < 32; ++t) {
            amax = amax > fabsf(v[t]) ? amax : fabsf(v[t]);
        }
        const float d = amax / 127.0f;
        const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
        store_u16(block, f32_to_f16(d));
        for (int t = 0; t < 32; ++t) {
            block[2 + t] = (u8)q8_quant(v[t] * inverse);
        }
    }
}
