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

// Stores `v` little-endian at `p`, which must be 2-byte aligned, in one 16-bit store (as
// `kv_store_f16` stores its halves). Splitting an f16 into two byte stores lost the low byte
// on an H200 (CUDA 13 NVRTC; the emulator kept it).
__device__ __forceinline__ void store_u16(u8* p, u16 v) {
#ifdef SPECULA_HOST_EMULATION
    emu_check_alignment(p, 2);
#endif
    *(u16*)p = v;
}

// Four 32-bit words, loaded from a 16-byte aligned address in one vector load.
struct alignas(16) U32x4 {
    u32 x, y, z, w;
};

// The 16 bytes at `p`, which must be 16-byte aligned (the emulator checks it; a GPU would
// fault on a misaligned vector load).
__device__ __forceinline__ U32x4 load_16(const void* p) {
#ifdef SPECULA_HOST_EMULATION
    emu_check_alignment(p, 16);
    U32x4 v;
    std::memcpy(&v, p, 16);
    return v;
#else
    return *(const U32x4*)p;
#endif
}

// Little-endian u32 at a 2-byte aligned address, in two 16-bit loads (the quants of Q8_0,
// Q4_0 and Q6_K blocks are only 2-byte aligned).
__device__ __forceinline__ u32 load_u32_from_u16s(const u8* p) {
#ifdef SPECULA_HOST_EMULATION
    emu_check_alignment(p, 2);
#endif
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// c + the dot product of the four signed bytes of a and b (PTX dp4a, compute 6.1+): exact.
__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
#ifdef SPECULA_HOST_EMULATION
    for (int i = 0; i < 32; i += 8) {
        c += (int)(i8)(a >> i) * (int)(i8)(b >> i);
    }
    return c;
#else
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
#endif
}

// Each byte of w minus k, as a signed byte, for bytes <= 0x7F and k <= 0x80: with the top bit
// of every byte set first, no byte borrows from its neighbour.
__device__ __forceinline__ u32 sub_bytes(u32 w, u32 k) {
    return ((w | 0x80808080u) - k * 0x01010101u) ^ 0x80808080u;
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

// Ints per row of a pass's row table (attention.cu, rope.cu): sequence slot, cache position,
// start of the tree path (-1 for a chain row), the tree's first position, RoPE position.
#define ROW_INFO 5

// One run of a Gated DeltaNet launch (conv.cu, gdn.cu): GDN_RUN 64-bit words at
// runs + r * GDN_RUN — the address of the sequence's ring planes, the run's first row in the
// pass, its rows, the plane its first row reads, and the plane its first row writes (-1: the
// one after the start plane).
#define GDN_RUN 5
struct GdnRun {
    float* planes;
    int first;
    int rows;
    int start_plane;
    int write_plane;
};

__device__ __forceinline__ GdnRun gdn_run(const long long* runs, int r) {
    const long long* p = runs + (u64)r * GDN_RUN;
    GdnRun run;
    run.planes = (float*)(u64)p[0];
    run.first = (int)p[1];
    run.rows = (int)p[2];
    run.start_plane = (int)p[3];
    run.write_plane = (int)p[4];
    return run;
}
