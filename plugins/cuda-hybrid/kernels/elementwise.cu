// Element-wise operations on f32 buffers of `n` values. Launch: blockDim = 256,
// grid = ceil(n / 256); thread i handles element i.

// dst[i] += src[i] (residual connections).
extern "C" __global__ void add_in_place(float* __restrict__ dst, const float* __restrict__ src,
                                        u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        dst[i] += src[i];
    }
}

// SwiGLU: gate[i] = silu(gate[i]) * up[i].
extern "C" __global__ void swiglu(float* __restrict__ gate, const float* __restrict__ up, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        gate[i] = silu_f(gate[i]) * up[i];
    }
}

// x[r * width + i] += bias[i] for `rows` rows of `width` values (the q/k/v projection biases
// of qwen2). Launch: blockDim = 256, grid = ceil(rows * width / 256).
extern "C" __global__ void add_row_bias(float* __restrict__ x, const float* __restrict__ bias,
                                        u64 rows, u64 width) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * width) {
        x[i] += bias[i % width];
    }
}
