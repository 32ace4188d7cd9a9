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
// at v_cache + slot(j) * n_head_kv * value_dim, stored as f32 (`attention`) or as IEEE
// binary16 bits (`attention_f16`, the `kv_type = "f16"` cache; each value widened to f32
// exactly before use, as the CPU backend does).
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
// Launch (both kernels at the end of the file): grid = (n_head, rows), blockDim = 128. Thread t
// scores keys t, t + 128, ... and accumulates output dimensions t, t + 128, ...

// Positions per block of a paged cache (the engine's BLOCK_TOKENS).
#define KV_BLOCK 64

// The cache row of position j.
__device__ __forceinline__ u64 kv_slot(const u32* __restrict__ table, int j) {
    return (u64)table[j / KV_BLOCK] * KV_BLOCK + (u64)(j % KV_BLOCK);
}

// One cache value as f32.
__device__ __forceinline__ float kv_value(const float* p, u64 i) {
    return p[i];
}
__device__ __forceinline__ float kv_value(const u16* p, u64 i) {
    return f16_to_f32(p[i]);
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
                                           float* qh) {
    const int h = blockIdx.x;
    const int r = blockIdx.y;
    const int tid = threadIdx.x;
    const int* info = row_info + (u64)r * ROW_INFO;
    const u32* table = tables + (u64)info[0] * table_stride;
    const int* path = info[2] >= 0 ? paths + info[2] : 0;
    const int tree_base = info[3];
    const int n_keys = path != 0 ? tree_base + path[0] : info[1] + 1;
    const int kv_head = h / (n_head / n_head_kv);
    const u64 k_width = (u64)n_head_kv * head_dim;
    const u64 v_width = (u64)n_head_kv * value_dim;
    const float* qs = q + (u64)r * q_row_stride + (u64)h * q_head_stride;
    for (int d = tid; d < head_dim; d += blockDim.x) {
        qh[d] = qs[d];
    }
    __syncthreads();

    float* sc = scores + ((u64)r * n_head + h) * score_stride;
    float local_max = __int_as_float(0xff800000);  // -inf
    for (int j = tid; j < n_keys; j += blockDim.x) {
        const int pj = (path != 0 && j >= tree_base) ? path[1 + j - tree_base] : j;
        const Kv* kj = k_cache + kv_slot(table, pj) * k_width + (u64)kv_head * head_dim;
        float s = 0.0f;
        // Unrolled so that the loads are in flight together; the sums keep their order.
#pragma unroll 8
        for (int d = 0; d < head_dim; ++d) {
            s = fmaf(qh[d], kv_value(kj, d), s);
        }
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

    float* o = out + (u64)r * n_head * value_dim + (u64)h * value_dim;
    for (int d = tid; d < value_dim; d += blockDim.x) {
        const Kv* vd = v_cache + (u64)kv_head * value_dim + d;
        float acc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < n_keys; ++j) {
            const int pj = (path != 0 && j >= tree_base) ? path[1 + j - tree_base] : j;
            acc = fmaf(sc[j] * inverse, kv_value(vd, kv_slot(table, pj) * v_width), acc);
        }
        if (gate != 0) {
            acc *= sigmoid_f(gate[(u64)r * gate_row_stride + (u64)h * gate_head_stride + d]);
        }
        o[d] = acc;
    }
}

extern "C" __global__ void attention(const float* __restrict__ q, u64 q_row_stride,
                                     int q_head_stride, const u32* __restrict__ tables,
                                     u64 table_stride, const int* __restrict__ row_info,
                                     const int* __restrict__ paths,
                                     const float* __restrict__ k_cache,
                                     const float* __restrict__ v_cache, int n_head,
                                     int n_head_kv, int head_dim, int value_dim, float scale,
                                     float* __restrict__ scores, u64 score_stride,
                                     const float* __restrict__ gate, u64 gate_row_stride,
                                     int gate_head_stride, float* __restrict__ out) {
    __shared__ double red[1024];
    __shared__ float redf[1024];
    __shared__ float qh[1024];
    attend_row<float>(q, q_row_stride, q_head_stride, tables, table_stride, row_info, paths,
                      k_cache, v_cache, n_head, n_head_kv, head_dim, value_dim, scale, scores,
                      score_stride, gate, gate_row_stride, gate_head_stride, out, red, redf, qh);
}

extern "C" __global__ void attention_f16(const float* __restrict__ q, u64 q_row_stride,
                                         int q_head_stride, const u32* __restrict__ tables,
                                         u64 table_stride, const int* __restrict__ row_info,
                                         const int* __restrict__ paths,
                                         const u16* __restrict__ k_cache,
                                         const u16* __restrict__ v_cache, int n_head,
                                         int n_head_kv, int head_dim, int value_dim, float scale,
                                         float* __restrict__ scores, u64 score_stride,
                                         const float* __restrict__ gate, u64 gate_row_stride,
                                         int gate_head_stride, float* __restrict__ out) {
    __shared__ double red[1024];
    __shared__ float redf[1024];
    __shared__ float qh[1024];
    attend_row<u16>(q, q_row_stride, q_head_stride, tables, table_stride, row_info, paths,
                    k_cache, v_cache, n_head, n_head_kv, head_dim, value_dim, scale, scores,
                    score_stride, gate, gate_row_stride, gate_head_stride, out, red, redf, qh);
}

// Stores rows * width f32 values of src (row r: the keys or values of the launch's row r)
// into the cache row of row r's position in its sequence (row_info and the tables as the
// attention kernels'; see kv_slot) at dst, as f32 (`kv_store`) or as binary16 bits rounded to
// nearest-even (`kv_store_f16`). Launch: blockDim = 256, grid = ceil(rows * width / 256);
// thread i handles value i.
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
