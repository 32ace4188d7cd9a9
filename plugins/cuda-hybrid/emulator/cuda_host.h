// A host stand-in for the CUDA execution model, so the kernel sources in ../kernels can be
// compiled as C++ and run on a machine without a GPU (tests only; the plugin never uses it on a
// real device). See `specula_cuda_hybrid::gpu::emulator`.
//
// Blocks run one after another on the calling OS thread, the last block first; the emulator's
// state is global, so the Rust side runs one launch at a time per process. The threads of a
// block are fibers (started with makecontext / swapcontext, then switched with _setjmp /
// _longjmp, which do not touch the signal mask and so need no system call): each runs until it
// finishes or waits at __syncthreads() (all live threads of the block) or at a warp shuffle
// (all live lanes of its warp); the scheduler resumes waiting fibers once everyone they wait
// for has arrived, as the hardware does, every other block from its last thread to its first.
// Threads that have returned no longer count, as on the GPU. A wait nobody can complete aborts
// with a message.
// __shared__ variables are function statics: shared by the block, which runs alone.
//
// What this does not model: warp-synchronous execution without explicit shuffles or barriers
// (the kernels do not rely on it), the memory model of concurrent blocks (blocks here never
// overlap), and CUDA's own math library (glibc's expf, cosf, ... stand in for it, so results
// may differ from a GPU in the last bits).

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define SPECULA_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct emu_dim3 {
    unsigned x, y, z;
};

static emu_dim3 emu_block_idx, emu_block_dim, emu_grid_dim;

namespace emu {

enum State { RUNNABLE, BLOCK_WAIT, WARP_WAIT, DONE };

struct Fiber {
    ucontext_t ctx;
    jmp_buf resume;
    bool started;
    State state;
};

static const size_t STACK_BYTES = 256 * 1024;
// Fibers live for the whole process: a fiber that finished its thread of one block waits to
// run the same thread index of the next block, so only its first start pays for swapcontext.
// (A fixed array: a ucontext_t must not move once made.)
static Fiber fibers[1024];
static unsigned created = 0;
static ucontext_t scheduler_ctx;
static jmp_buf scheduler;
static unsigned current = 0;
static const std::function<void()>* body = nullptr;
// Shuffle slots, double-buffered by the parity of each warp's barrier generation.
static unsigned shuffle_slots[2][1024];
static unsigned warp_generation[32];
// Blocks run so far, in every launch (their parity picks the order a block's threads start in).
static unsigned blocks_run = 0;

static void entry() {
    for (;;) {
        (*body)();
        fibers[current].state = DONE;
        if (_setjmp(fibers[current].resume) == 0) {
            _longjmp(scheduler, 1);
        }
    }
}

static void wait(State state) {
    fibers[current].state = state;
    if (_setjmp(fibers[current].resume) == 0) {
        _longjmp(scheduler, 1);
    }
}

// Runs fiber i until it waits or finishes.
static void resume(unsigned i) {
    current = i;
    if (_setjmp(scheduler) == 0) {
        if (!fibers[i].started) {
            fibers[i].started = true;
            swapcontext(&scheduler_ctx, &fibers[i].ctx);
        } else {
            _longjmp(fibers[i].resume, 1);
        }
    }
}

// Runs `n` threads of one block to completion.
static void run_block(unsigned n, const std::function<void()>& kernel) {
    if (n == 0 || n > 1024) {
        std::fprintf(stderr, "cuda emulator: block of %u threads\n", n);
        std::abort();
    }
    body = &kernel;
    for (; created < n; ++created) {
        Fiber& f = fibers[created];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = static_cast<char*>(std::malloc(STACK_BYTES));
        f.ctx.uc_stack.ss_size = STACK_BYTES;
        f.ctx.uc_link = &scheduler_ctx;
        makecontext(&f.ctx, entry, 0);
        f.started = false;
    }
    for (unsigned i = 0; i < n; ++i) {
        fibers[i].state = RUNNABLE;
    }
    std::fill(std::begin(warp_generation), std::end(warp_generation), 0u);
    const unsigned n_warps = (n + 31) / 32;
    // Every other block runs its threads last first: a kernel that reads shared memory another
    // thread writes without a barrier between them passes in one order and fails in the other.
    const bool last_first = (blocks_run++ & 1u) != 0;
    for (;;) {
        for (unsigned k = 0; k < n; ++k) {
            const unsigned i = last_first ? n - 1 - k : k;
            if (fibers[i].state == RUNNABLE) {
                resume(i);
            }
        }
        unsigned live = 0, at_block = 0;
        for (unsigned i = 0; i < n; ++i) {
            live += fibers[i].state != DONE;
            at_block += fibers[i].state == BLOCK_WAIT;
        }
        if (live == 0) {
            return;
        }
        bool released = false;
        if (at_block == live) {
            for (unsigned i = 0; i < n; ++i) {
                if (fibers[i].state == BLOCK_WAIT) {
                    fibers[i].state = RUNNABLE;
                }
            }
            released = true;
        }
        for (unsigned w = 0; w < n_warps; ++w) {
            unsigned lanes_live = 0, at_warp = 0;
            for (unsigned i = w * 32; i < std::min(n, w * 32 + 32); ++i) {
                lanes_live += fibers[i].state != DONE;
                at_warp += fibers[i].state == WARP_WAIT;
            }
            if (at_warp > 0 && at_warp == lanes_live) {
                for (unsigned i = w * 32; i < std::min(n, w * 32 + 32); ++i) {
                    if (fibers[i].state == WARP_WAIT) {
                        fibers[i].state = RUNNABLE;
                    }
                }
                warp_generation[w] += 1;
                released = true;
            }
        }
        if (!released) {
            std::fprintf(stderr, "cuda emulator: deadlock (%u threads live, %u at a block barrier)\n",
                         live, at_block);
            std::abort();
        }
    }
}

inline emu_dim3 thread_idx() {
    return emu_dim3{current, 0, 0};
}

template <typename... A, std::size_t... I>
static void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// Runs `kernel` over the grid with `block` threads per block; args[i] points at argument i.
template <typename... A>
static void launch(void (*kernel)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned block,
                   void** args) {
    emu_grid_dim = emu_dim3{gx, gy, gz};
    emu_block_dim = emu_dim3{block, 1, 1};
    const std::function<void()> run = [&]() {
        call(kernel, args, std::index_sequence_for<A...>{});
    };
    // Last block first: CUDA runs a grid's blocks in no set order, and a kernel that leaned on
    // one block finishing before a later one would pass in grid order and fail on a GPU.
    for (unsigned z = gz; z-- > 0;) {
        for (unsigned y = gy; y-- > 0;) {
            for (unsigned x = gx; x-- > 0;) {
                emu_block_idx = emu_dim3{x, y, z};
                run_block(block, run);
            }
        }
    }
}

}  // namespace emu

#define blockIdx emu_block_idx
#define blockDim emu_block_dim
#define gridDim emu_grid_dim
#define threadIdx (emu::thread_idx())

inline void __syncthreads() {
    emu::wait(emu::BLOCK_WAIT);
}

// A warp shuffle of 32 bits: lane t gets the value of lane t ^ lane_mask.
inline unsigned emu_shfl_xor_bits(unsigned v, int lane_mask) {
    const unsigned t = emu::current;
    const unsigned w = t / 32;
    const unsigned g = emu::warp_generation[w] & 1u;
    emu::shuffle_slots[g][t] = v;
    emu::wait(emu::WARP_WAIT);
    const unsigned partner = (t & ~31u) | ((t & 31u) ^ static_cast<unsigned>(lane_mask));
    return emu::shuffle_slots[g][partner];
}

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned bits;
    std::memcpy(&bits, &v, 4);
    bits = emu_shfl_xor_bits(bits, lane_mask);
    std::memcpy(&v, &bits, 4);
    return v;
}

inline int __shfl_xor_sync(unsigned, int v, int lane_mask) {
    return static_cast<int>(emu_shfl_xor_bits(static_cast<unsigned>(v), lane_mask));
}

// The rounding intrinsics: plain IEEE operations on the host (the emulator is built with
// -ffp-contract=off, so none is fused with another), a fused multiply-add for __fmaf_rn.
inline float __fmul_rn(float a, float b) {
    return a * b;
}

inline float __fadd_rn(float a, float b) {
    return a + b;
}

inline float __fdiv_rn(float a, float b) {
    return a / b;
}

inline float __fmaf_rn(float a, float b, float c) {
    return std::fma(a, b, c);
}

// Round to nearest, ties to even (the default rounding mode).
inline int __float2int_rn(float v) {
    return static_cast<int>(std::nearbyint(v));
}

// A misaligned load faults on a GPU; here it stops the test process with a message.
inline void emu_check_alignment(const void* p, unsigned alignment) {
    if (reinterpret_cast<std::uintptr_t>(p) % alignment != 0) {
        std::fprintf(stderr, "cuda emulator: %u-byte aligned load from %p\n", alignment, p);
        std::abort();
    }
}

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}

inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}

using std::max;
using std::min;

// IEEE binary16 <-> f32 (round to nearest even), as the PTX cvt instructions.
inline float emu_f16_to_f32(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16;
    unsigned exponent = (h >> 10) & 0x1f;
    unsigned mantissa = h & 0x3ffu;
    unsigned bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else {
            exponent = 113;
            while ((mantissa & 0x400u) == 0) {
                mantissa <<= 1;
                exponent -= 1;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    return __uint_as_float(bits);
}

inline unsigned short emu_f32_to_f16(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    const unsigned sign = (x >> 16) & 0x8000u;
    const unsigned abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) {  // inf or NaN
        return static_cast<unsigned short>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    }
    if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
        return static_cast<unsigned short>(sign | 0x7c00u);
    }
    if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        const unsigned shift = 113 - (abs >> 23);
        if (shift > 12) {  // below half the smallest subnormal: zero
            return static_cast<unsigned short>(sign);
        }
        const unsigned mantissa = (abs & 0x7fffffu) | 0x800000u;
        unsigned half = mantissa >> (shift + 13);
        const unsigned rest = mantissa & ((1u << (shift + 13)) - 1);
        const unsigned halfway = 1u << (shift + 12);
        if (rest > halfway || (rest == halfway && (half & 1u))) {
            half += 1;
        }
        return static_cast<unsigned short>(sign | half);
    }
    unsigned half = ((abs >> 13) - (112u << 10));
    const unsigned rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) {
        half += 1;
    }
    return static_cast<unsigned short>(sign | half);
}
