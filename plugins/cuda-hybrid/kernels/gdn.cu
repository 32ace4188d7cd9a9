// The Gated DeltaNet recurrence of qwen35 / qwen3next, per token, over S x S state matrices
// that live in the device snapshot ring (see conv.cu for the ring layout; a layer's S matrices
// follow its conv state, at layer_offset + conv_len, value head h's matrix at h * S * S, row j
// = value dimension j, column i = key dimension i, as llama.cpp and the CPU backend store it).

// L2-normalises the q and k heads of the convolved rows in place: x / max(sqrt(sum x^2), eps)
// (squares summed in f64), q additionally times q_scale = 1 / sqrt(S). Row t is `channels`
// values [q (n_k_heads * S) | k (n_k_heads * S) | v] at x + t * channels.
// Launch: grid = (2 * n_k_heads, rows) (q heads, then k heads), blockDim = a fixed power of two
// >= S; thread i handles element i.
extern "C" __global__ void gdn_qk_l2norm(float* __restrict__ x, int channels, int n_k_heads,
                                         int head_dim, float eps, float q_scale) {
    __shared__ double red[1024];
    const int hh = blockIdx.x;
    const int t = blockIdx.y;
    const int i = threadIdx.x;
    float* head = x + (u64)t * channels + (u64)hh * head_dim;
    const float v = i < head_dim ? head[i] : 0.0f;
    const double sum = block_sum_f64(i < head_dim ? (double)(v * v) : 0.0, red);
    const float scale = 1.0f / fmaxf(sqrtf((float)sum), eps);
    if (i < head_dim) {
        float y = v * scale;
        if (hh < n_k_heads) {
            y *= q_scale;
        }
        head[i] = y;
    }
}

// The recurrence, token by token (tokens depend on each other through the state). Value
// head h reads key head h % n_k_heads (head_map 0, qwen35's tiled order) or
// h / (n_v_heads / n_k_heads) (head_map 1, qwen3next). For token t:
//   beta = sigmoid(b), g = softplus(a + dt_bias[h]) * ssm_a[h], decay = exp(g);
//   row j:  M_j <- decay * M_j;  d_j = (v_j - M_j . k) * beta;  M_j <- M_j + d_j * k;
//           o_j = M_j . q;
//   out[t][h*S + j] = o_j (gdn_gated_norm below then norms and gates it).
// A launch runs several runs of rows (common.cuh's GdnRun: one sequence's consecutive rows
// each, independent of each other), a run's tokens in order. Token t of a run writes its
// state to plane (first + t) % n_planes of the run's ring, first = write_plane when it is
// >= 0 (a run of a tree's rows, each the child of the one before, the first reading its
// parent's state) else start_plane + 1; token 0 reads the start plane. conv_out, beta_raw,
// alpha_raw and out are the pass's rows; a run's are from its first row.
// b and a: `grouped` 0 (qwen35): beta_raw[t * n_v_heads + h], alpha_raw[t * n_v_heads + h];
// `grouped` 1 (qwen3next ssm_ba, both pointers the same buffer of 2 * n_v_heads per row): per
// key head, n_v/n_k betas then n_v/n_k alphas.
//
// State row j depends on nothing but itself and the token's inputs, so each row is one warp's
// for all the launch's tokens, held in registers: lane l owns columns l, l + 32, ... (S <=
// 32 * GDN_PER_LANE). The dot products are summed per lane in column order, then across the
// lanes by warp_sum, the same for every token whatever the launch's row count.
// Launch: grid = (n_v_heads, ceil(S / GDN_WARPS), n_runs), blockDim = 32 * GDN_WARPS; warp w of
// block (h, y, z) owns row j = y * GDN_WARPS + w of head h in run z.
#define GDN_WARPS 4
#define GDN_PER_LANE 8
extern "C" __global__ void gdn_recurrence(const float* __restrict__ conv_out, int channels,
                                          const float* __restrict__ beta_raw,
                                          const float* __restrict__ alpha_raw, int grouped,
                                          const float* __restrict__ dt_bias,
                                          const float* __restrict__ ssm_a,
                                          const long long* __restrict__ runs,
                                          u64 plane_len, u64 layer_offset, u64 conv_len,
                                          int n_planes, int head_dim, int n_k_heads,
                                          int n_v_heads, int head_map, float* __restrict__ out) {
    const GdnRun run = gdn_run(runs, blockIdx.z);
    float* planes = run.planes;
    const int start_plane = run.start_plane;
    const int write_plane = run.write_plane;
    const int rows = run.rows;
    const int h = blockIdx.x;
    const int lane = threadIdx.x % 32;
    const int j = blockIdx.y * GDN_WARPS + threadIdx.x / 32;
    const int S = head_dim;
    if (j >= S) {
        return;  // warp-uniform
    }
    const int per_lane = (S + 31) / 32;
    const int kh = head_map == 0 ? h % n_k_heads : h / (n_v_heads / n_k_heads);
    const u64 key_dim = (u64)n_k_heads * S;
    const u64 value_dim = (u64)n_v_heads * S;
    const int per_group = n_v_heads / n_k_heads;
    const float dt = dt_bias[h];
    const float a_h = ssm_a[h];
    const u64 row_at = layer_offset + conv_len + (u64)h * S * S + (u64)j * S;
    const int first = write_plane >= 0 ? write_plane : (start_plane + 1) % n_planes;

    float m[GDN_PER_LANE];
    const float* m_in = planes + (u64)start_plane * plane_len + row_at;
#pragma unroll
    for (int c = 0; c < GDN_PER_LANE; ++c) {
        const int i = lane + 32 * c;
        m[c] = c < per_lane && i < S ? m_in[i] : 0.0f;
    }
    for (int t = 0; t < rows; ++t) {
        const int pass_row = run.first + t;
        const float* row = conv_out + (u64)pass_row * channels;
        float ks[GDN_PER_LANE], qs[GDN_PER_LANE];
#pragma unroll
        for (int c = 0; c < GDN_PER_LANE; ++c) {
            const int i = lane + 32 * c;
            const bool in = c < per_lane && i < S;
            qs[c] = in ? row[(u64)kh * S + i] : 0.0f;
            ks[c] = in ? row[key_dim + (u64)kh * S + i] : 0.0f;
        }
        const float v_j = row[2 * key_dim + (u64)h * S + j];
        float b, a;
        if (grouped) {
            const u64 base =
                (u64)pass_row * 2 * n_v_heads + (u64)(h / per_group) * 2 * per_group;
            b = beta_raw[base + h % per_group];
            a = alpha_raw[base + per_group + h % per_group];
        } else {
            b = beta_raw[(u64)pass_row * n_v_heads + h];
            a = alpha_raw[(u64)pass_row * n_v_heads + h];
        }
        const float beta = sigmoid_f(b);
        const float g = softplus_f(a + dt) * a_h;
        const float decay = expf(g);

        float predicted = 0.0f;
#pragma unroll
        for (int c = 0; c < GDN_PER_LANE; ++c) {
            m[c] *= decay;
            predicted = fmaf(m[c], ks[c], predicted);
        }
        predicted = warp_sum(predicted);
        const float delta = (v_j - predicted) * beta;
        float* m_out = planes + (u64)((first + t) % n_planes) * plane_len + row_at;
        float o = 0.0f;
#pragma unroll
        for (int c = 0; c < GDN_PER_LANE; ++c) {
            const int i = lane + 32 * c;
            m[c] = fmaf(delta, ks[c], m[c]);
            if (c < per_lane && i < S) {
                m_out[i] = m[c];
            }
            o = fmaf(m[c], qs[c], o);
        }
        o = warp_sum(o);
        if (lane == 0) {
            out[(u64)pass_row * value_dim + (u64)h * S + j] = o;
        }
    }
}

// The gated output norm of the recurrence's rows, in place:
//   out[t][h*S + j] = rms_norm(o)_j * norm_w[j] * silu(z[t][h*S + j])  (squares in f64).
// Launch: grid = (n_v_heads, rows), blockDim = S (<= 1024); thread j handles value j.
extern "C" __global__ void gdn_gated_norm(float* __restrict__ out,
                                          const float* __restrict__ z,
                                          const float* __restrict__ norm_w, float eps,
                                          int head_dim, int n_v_heads) {
    __shared__ double red[1024];
    const int h = blockIdx.x;
    const int t = blockIdx.y;
    const int j = threadIdx.x;
    const int S = head_dim;
    const u64 at = (u64)t * n_v_heads * S + (u64)h * S + j;
    const float o = out[at];
    const double sum = block_sum_f64((double)(o * o), red);
    const float mean = (float)(sum / (double)S);
    const float scale = 1.0f / sqrtf(mean + eps);
    out[at] = ((o * scale) * norm_w[j]) * silu_f(z[at]);
}
