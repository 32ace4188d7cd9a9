// Mixture-of-experts routing and combination for qwen3next, as the CPU backend (llama.cpp's
// build_moe_ffn for that architecture).

// Routing of one row: softmax over the n_expert router logits (exp(x - max), sum in f64,
// scaled by the f32 reciprocal), the k most probable experts (ties: the lower index first),
// their probabilities normalised to sum 1 (sum in f64, clamped below at 2^-14 as ggml does)
// and multiplied by weights_scale unless it is 0 or 1. Writes ids[row * k + rank] and
// weights[row * k + rank]; `logits` (row-major, n_expert per row) is overwritten with the
// probabilities.
// Launch: grid = rows, blockDim = 256; the selection runs on thread 0 (k * n_expert steps).
extern "C" __global__ void moe_route(float* __restrict__ logits, int n_expert, int k,
                                     float weights_scale, int* __restrict__ ids,
                                     float* __restrict__ weights) {
    __shared__ double red[1024];
    __shared__ float redf[1024];
    const int r = blockIdx.x;
    const int tid = threadIdx.x;
    float* p = logits + (u64)r * n_expert;
    float local_max = __int_as_float(0xff800000);  // -inf
    for (int e = tid; e < n_expert; e += blockDim.x) {
        local_max = fmaxf(local_max, p[e]);
    }
    const float max = block_max_f32(local_max, redf);
    double local_sum = 0.0;
    for (int e = tid; e < n_expert; e += blockDim.x) {
        const float v = expf(p[e] - max);
        p[e] = v;
        local_sum += (double)v;
    }
    const double sum = block_sum_f64(local_sum, red);
    const float inverse = (float)(1.0 / sum);
    for (int e = tid; e < n_expert; e += blockDim.x) {
        p[e] *= inverse;
    }
    __syncthreads();
    if (tid != 0) {
        return;
    }
    int* row_ids = ids + (u64)r * k;
    float* row_w = weights + (u64)r * k;
    double total = 0.0;
    for (int rank = 0; rank < k; ++rank) {
        int best = -1;
        for (int e = 0; e < n_expert; ++e) {
            bool taken = false;
            for (int q = 0; q < rank; ++q) {
                taken = taken || row_ids[q] == e;
            }
            if (!taken && (best < 0 || p[e] > p[best])) {
                best = e;
            }
        }
        row_ids[rank] = best;
        row_w[rank] = p[best];
        total += (double)p[best];
    }
    const float norm = fmaxf((float)total, 6.103515625e-5f);
    for (int rank = 0; rank < k; ++rank) {
        float w = row_w[rank] / norm;
        if (weights_scale != 0.0f && weights_scale != 1.0f) {
            w *= weights_scale;
        }
        row_w[rank] = w;
    }
}

// out[r][d] = sum over ranks (in rank order) of weights[r][rank] * expert_out[r * k + rank][d].
// Launch: blockDim = 256, grid = (ceil(n_embd / 256), rows).
extern "C" __global__ void moe_combine(const float* __restrict__ expert_out,
                                       const float* __restrict__ weights, int k, int n_embd,
                                       float* __restrict__ out) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y;
    if (d >= n_embd) {
        return;
    }
    float acc = 0.0f;
    for (int rank = 0; rank < k; ++rank) {
        const float v = expert_out[((u64)r * k + rank) * n_embd + d] * weights[(u64)r * k + rank];
        acc = rank == 0 ? v : acc + v;
    }
    out[(u64)r * n_embd + d] = acc;
}

// The shared expert's gated contribution: out[r][d] += shared[r][d] * sigmoid(gate[r]).
// Launch: blockDim = 256, grid = (ceil(n_embd / 256), rows).
extern "C" __global__ void add_gated(float* __restrict__ out, const float* __restrict__ shared,
                                     const float* __restrict__ gate, int n_embd) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = blockIdx.y;
    if (d >= n_embd) {
        return;
    }
    const u64 i = (u64)r * n_embd + d;
    out[i] += shared[i] * sigmoid_f(gate[r]);
}
