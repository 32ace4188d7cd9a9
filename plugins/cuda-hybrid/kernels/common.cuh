// Device helpers shared by every kernel file. The plugin prepends this text to each `.cu`
// source before NVRTC compiles it (NVRTC has no include path here), so nothing in it may
// depend on a CUDA header: f16 conversions use PTX `cvt` instructions, integer types are
// spelled out.
//
// Determinism rule for every kernel: each output value is produced by one fixed sequence of
// operations that depends only on the kernel's inputs and the launch shape documented on the
// kernel, never on how many other rows are in the launch, on timing, or on atomics. Block
// reductions below use a fixed tree over shared memory.
//
// SPECULA_HOST_EMULATION is defined only when the tests compile these sources as C++ for the
// host stand-in of the CUDA execution model (`emulator/cuda_host.h`); NVRTC never sees it.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// IEEE binary16 bits -> f32.
__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifdef SPECULA_HOST_EMULATION
    return emu_f16_to_f32(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

// f32 -> IEEE binary16 bits, round to nearest even (as the `half` crate on the CPU).
__device__ __forceinline__ u16 f32_to_f16(float f) {
#ifdef SPECULA_HOST_EMULATION
    return emu_f32_to_f16(f);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// bfloat16 bits -> f32.
__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Little-endian u16 at any byte address (quant blocks are not always 2-byte aligned).
__device__ __forceinline__ u16 load_u16(const u8* p) {
    return (u16)((u32)p[0] | ((u32)p[1] << 8));
}

__device__ __forceinline__ float sigmoid_f(float x) {
    return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float silu_f(float x) {
    return x / (1.0f + expf(-x));
}

// ln(1 + e^x), x itself above 20 (ggml's threshold, as the CPU kernels).
__device__ __forceinline__ float softplus_f(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// Sum over the 32 lanes of a warp by a fixed butterfly: every lane gets the same value, and
// the order of additions depends only on the lane values.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Largest power of two <= n (n >= 1).
__device__ __forceinline__ int floor_pow2(int n) {
    int p = 1;
    while (p * 2 <= n) {
        p *= 2;
    }
    return p;
}

// Sum of `v` over the block's threads (any blockDim.x <= 1024) by a fixed tree: first the
// threads past the largest power of two fold into the lower ones, then halving. `scratch`
// holds blockDim.x doubles. Every thread gets the result. Must be reached by every thread.
__device__ double block_sum_f64(double v, double* scratch) {
    const int n = blockDim.x;
    const int tid = threadIdx.x;
    scratch[tid] = v;
    __syncthreads();
    const int p = floor_pow2(n);
    if (tid < n - p) {
        scratch[tid] += scratch[tid + p];
    }
    __syncthreads();
    for (int s = p / 2; s > 0; s >>= 1) {
        if (tid < s) {
            scratch[tid] += scratch[tid + s];
        }
        __syncthreads();
    }
    double total = scratch[0];
    __syncthreads();
    return total;
}

// Maximum of `v` over the block's threads; `scratch` holds blockDim.x floats.
__device__ float block_max_f32(float v, float* scratch) {
    const int n = blockDim.x;
    const int tid = threadIdx.x;
    scratch[tid] = v;
    __syncthreads();
    const int p = floor_pow2(n);
    if (tid < n - p) {
        scratch[tid] = fmaxf(scratch[tid], scratch[tid + p]);
    }
    __syncthreads();
    for (int s = p / 2; s > 0; s >>= 1) {
        if (tid < s) {
            scratch[tid] = fmaxf(scratch[tid], scratch[tid + s]);
        }
        __syncthreads();
    }
    float result = scratch[0];
    __syncthreads();
    return result;
}
