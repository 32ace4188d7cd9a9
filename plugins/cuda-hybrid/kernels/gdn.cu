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

// The recurrence and the gated output norm, token by token (tokens depend on each other
// through the state). Value head h reads key head h % n_k_heads (head_map 0, qwen35's tiled
// order) or h / (n_v_heads / n_k_heads) (head_map 1, qwen3next). For token t:
//   beta = sigmoid(b), g = softplus(a + dt_bias[h]) * ssm_a[h], decay = exp(g);
//   row j:  M_j <- decay * M_j;  d_j = (v_j - M_j . k) * beta;  M_j <- M_j + d_j * k;
//           o_j = M_j . q;
//   out[t][h*S + j] = rms_norm(o)_j * norm_w[j] * silu(z[t][h*S + j])  (squares in f64).
// Token t writes its state to plane (first + t) % n_planes, first = write_plane when it is
// >= 0 (a run of a tree's rows, each the child of the one before, the first reading its
// parent's state) else start_plane + 1; it reads the start plane (t = 0) or the plane the
// token before wrote. Row j is only ever touched by thread j, so no synchronisation is needed
// for the state.
// b and a: `grouped` 0 (qwen35): beta_raw[t * n_v_heads + h], alpha_raw[t * n_v_heads + h];
// `grouped` 1 (qwen3next ssm_ba, both pointers the same buffer of 2 * n_v_heads per row): per
// key head, n_v/n_k betas then n_v/n_k alphas.
// Launch: grid = n_v_heads, blockDim = S (<= 1024); thread j owns state row j.
extern "C" __global__ void gdn_recurrence(const float* __restrict__ conv_out, int channels,
                                          const float* __restrict__ z,
                                          const float* __restrict__ beta_raw,
                                          const float* __restrict__ alpha_raw, int grouped,
                                          const float* __restrict__ dt_bias,
                                          const float* __restrict__ ssm_a,
                                          const float* __restrict__ norm_w, float eps,
                                          float* planes, u64 plane_len, u64 layer_offset,
                                          u64 conv_len, int n_planes, int start_plane,
                                          int write_plane, int rows,
                                          int head_dim, int n_k_heads, int n_v_heads,
                                          int head_map, float* __restrict__ out) {
    __shared__ double red[1024];
    __shared__ float qs[1024];
    __shared__ float ks[1024];
    const int h = blockIdx.x;
    const int j = threadIdx.x;
    const int S = head_dim;
    const int kh = head_map == 0 ? h % n_k_heads : h / (n_v_heads / n_k_heads);
    const u64 key_dim = (u64)n_k_heads * S;
    const u64 value_dim = (u64)n_v_heads * S;
    const int per_group = n_v_heads / n_k_heads;
    const float dt = dt_bias[h];
    const float a_h = ssm_a[h];
    const float w_j = norm_w[j];

    for (int t = 0; t < rows; ++t) {
        const float* row = conv_out + (u64)t * channels;
        qs[j] = row[(u64)kh * S + j];
        ks[j] = row[key_dim + (u64)kh * S + j];
        const float v_j = row[2 * key_dim + (u64)h * S + j];
        float b, a;
        if (grouped) {
            const u64 base = (u64)t * 2 * n_v_heads + (u64)(h / per_group) * 2 * per_group;
            b = beta_raw[base + h % per_group];
            a = alpha_raw[base + per_group + h % per_group];
        } else {
            b = beta_raw[(u64)t * n_v_heads + h];
            a = alpha_raw[(u64)t * n_v_heads + h];
        }
        const float beta = sigmoid_f(b);
        const float g = softplus_f(a + dt) * a_h;
        const float decay = expf(g);
        __syncthreads();

        const int first = write_plane >= 0 ? write_plane : (start_plane + 1) % n_planes;
        const int read = t == 0 ? start_plane : (first + t - 1) % n_planes;
        const int write = (first + t) % n_planes;
        const float* m_in = planes + (u64)read * plane_len + layer_offset + conv_len +
                            (u64)h * S * S + (u64)j * S;
        float* m_out = planes + (u64)write * plane_len + layer_offset + conv_len +
                       (u64)h * S * S + (u64)j * S;
        float predicted = 0.0f;
        for (int i = 0; i < S; ++i) {
            const float m = m_in[i] * decay;
            m_out[i] = m;
            predicted = fmaf(m, ks[i], predicted);
        }
        const float delta = (v_j - predicted) * beta;
        float o = 0.0f;
        for (int i = 0; i < S; ++i) {
            const float m = fmaf(delta, ks[i], m_out[i]);
            m_out[i] = m;
            o = fmaf(m, qs[i], o);
        }

        const double sum = block_sum_f64((double)(o * o), red);
        const float mean = (float)(sum / (double)S);
        const float scale = 1.0f / sqrtf(mean + eps);
        const float gate = z[(u64)t * value_dim + (u64)h * S + j];
        out[(u64)t * value_dim + (u64)h * S + j] = ((o * scale) * w_j) * silu_f(gate);
        // block_sum_f64 ends with __syncthreads, so qs / ks may be overwritten next.
    }
}
