// Per-head RMSNorm (optional) and rotary position embedding of query or key heads, in one pass.
//
// Head h of row r is `head_dim` values at in + r * in_row_stride + h * in_head_stride; the
// result goes to out + r * out_row_stride + h * out_head_stride (in place allowed). Row r has
// position row_info[r * ROW_INFO + 4] + pos_offset (the pass's row table), or pos0 + r +
// pos_offset where `row_info` is null (pos_offset is 1 for the MTP head, whose cache entry p
// holds the token of position p + 1).
//
// 1. With `norm_w`, the head is RMS-normalised: squares summed in f64, (x * scale) * w.
// 2. The first n_rot dimensions are rotated in n_rot / 2 pairs; the rest pass through.
//    `mode` 0 is ggml's "normal" RoPE (pairs (2i, 2i + 1), llama), 1 is NeoX (pairs
//    (i, i + n_rot/2), qwen3, qwen3next), 2 is multi-section RoPE (NeoX pairs, qwen35): pair i
//    belongs to one of four position components by the sections s0..s3 (interleaved IMROPE or
//    contiguous MROPE); for text the first three components are the token position and the
//    fourth is 0, so its pairs are not rotated.
//    Angle of pair i: freq_scale * (theta_i / factor_i) with theta_0 = position and
//    theta_{i+1} = theta_i * theta_scale in f32 (theta_scale = freq_base^(-2/n_rot), computed
//    on the host as the CPU backend does), so the angles are the CPU's bit for bit; cos and
//    sin are CUDA's precise cosf / sinf.
//
// Launch: grid = (n_heads, rows), blockDim = a fixed power of two >= head_dim (<= 1024);
// thread d handles dimension d (and pair d when d < n_rot / 2).

__device__ __forceinline__ int rope_component(int pair, int s0, int s1, int s2, int s3,
                                              int interleaved) {
    const int total = max(s0 + s1 + s2 + s3, 1);
    const int sector = pair % total;
    if (interleaved) {
        const int m3 = sector % 3;
        if (m3 == 0 && sector < 3 * s0) return 0;
        if (m3 == 1 && sector < 3 * s1) return 1;
        if (m3 == 2 && sector < 3 * s2) return 2;
        return 3;
    }
    if (sector < s0) return 0;
    if (sector < s0 + s1) return 1;
    if (sector < s0 + s1 + s2) return 2;
    return 3;
}

extern "C" __global__ void qk_norm_rope(const float* in, u64 in_row_stride, int in_head_stride,
                                        float* out, u64 out_row_stride, int out_head_stride,
                                        int head_dim, const float* __restrict__ norm_w, float eps,
                                        const int* __restrict__ row_info, int pos0,
                                        int pos_offset, int n_rot, int mode,
                                        float theta_scale, float freq_scale,
                                        const float* __restrict__ freq_factors, int s0, int s1,
                                        int s2, int s3, int interleaved) {
    __shared__ double red[1024];
    __shared__ float head[1024];
    const int d = threadIdx.x;
    const int h = blockIdx.x;
    const int r = blockIdx.y;
    const float* src = in + (u64)r * in_row_stride + (u64)h * in_head_stride;
    float* dst = out + (u64)r * out_row_stride + (u64)h * out_head_stride;

    const float v = d < head_dim ? src[d] : 0.0f;
    if (norm_w != 0) {
        const double sum = block_sum_f64(d < head_dim ? (double)(v * v) : 0.0, red);
        const float mean = (float)(sum / (double)head_dim);
        const float scale = 1.0f / sqrtf(mean + eps);
        if (d < head_dim) {
            head[d] = (v * scale) * norm_w[d];
        }
    } else if (d < head_dim) {
        head[d] = v;
    }
    __syncthreads();

    const int pairs = n_rot / 2;
    if (d < pairs) {
        const int pos = (row_info != 0 ? row_info[(u64)r * ROW_INFO + 4] : pos0 + r) + pos_offset;
        float theta = (float)pos;
        for (int i = 0; i < d; ++i) {
            theta *= theta_scale;
        }
        const float factor = freq_factors != 0 ? freq_factors[d] : 1.0f;
        float angle = freq_scale * (theta / factor);
        if (mode == 2 && rope_component(d, s0, s1, s2, s3, interleaved) == 3) {
            angle = 0.0f;
        }
        const float c = cosf(angle);
        const float s = sinf(angle);
        const int a = mode == 0 ? 2 * d : d;
        const int b = mode == 0 ? 2 * d + 1 : d + pairs;
        const float x0 = head[a];
        const float x1 = head[b];
        dst[a] = x0 * c - x1 * s;
        dst[b] = x0 * s + x1 * c;
    }
    if (d >= n_rot && d < head_dim) {
        dst[d] = head[d];
    }
}
