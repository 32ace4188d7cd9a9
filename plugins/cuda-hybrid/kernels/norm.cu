// RMSNorm of rows: out[r][i] = (x[r][i] * scale_r) * w[i], scale_r = 1 / sqrt(mean(x[r]^2) + eps),
// as the CPU backend (ggml's rms_norm followed by mul): the squares are summed in f64, the
// mean and the scale are f32.
//
// Rows are `n` values at x + r * x_stride, written to out + r * out_stride (in place allowed).
// Used for the residual-stream norms, the final norm before the LM head and the MTP head's
// input norms.
//
// Launch: grid = rows (one block per row), blockDim = 256 (any size up to 1024 works; the
// result depends only on blockDim, which the host keeps fixed).
extern "C" __global__ void rms_norm(const float* x, u64 x_stride,
                                    const float* __restrict__ w, float eps, int n,
                                    float* out, u64 out_stride) {
    __shared__ double red[1024];
    const float* xr = x + (u64)blockIdx.x * x_stride;
    float* o = out + (u64)blockIdx.x * out_stride;
    double sum = 0.0;
    // Unrolled so that a thread's loads are in flight together; the sum keeps its order.
#pragma unroll 8
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i];
        sum += (double)(v * v);
    }
    sum = block_sum_f64(sum, red);
    const float mean = (float)(sum / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    // Eight values of x and w loaded before any is stored: x and out may be the same row, so
    // the compiler keeps a load after an earlier store, and a load-store loop would wait for
    // memory once per value.
    for (int base = threadIdx.x; base < n; base += 8 * blockDim.x) {
        float xv[8], wv[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = base + k * blockDim.x;
            xv[k] = i < n ? xr[i] : 0.0f;
            wv[k] = i < n ? w[i] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int i = base + k * blockDim.x;
            if (i < n) {
                o[i] = (xv[k] * scale) * wv[k];
            }
        }
    }
}
