// The causal depthwise convolution of a Gated DeltaNet layer, with its conv state kept in the
// device snapshot ring.
//
// A sequence's ring holds n_planes planes of plane_len floats; a layer's state inside a plane
// starts at layer_offset and begins with its conv state: (kernel - 1) rows of `channels`
// inputs, oldest first. A launch convolves several runs of rows (common.cuh's GdnRun: one
// sequence's consecutive rows each, runs independent of each other: at most one per sequence).
// Token t of a run reads the state at plane (start_plane + t) % n_planes of the run's ring
// and writes the next one to plane (start_plane + t + 1) % n_planes, exactly as the CPU ring
// does. Since a token's state is only the last kernel - 1 inputs, every token is computed from
// the start plane and the run's own inputs, so all tokens run in parallel; the host keeps a
// run's rows <= n_planes - 1 so no token writes the start plane. With write_plane >= 0 (a run
// of a tree's rows, each the child of the one before, the first continuing its parent's state
// in the start plane) token t writes plane (write_plane + t) % n_planes.
//
// out[t][c] = silu(sum_i window_i * taps[c][i]), window = the kernel - 1 state rows then the
// current input mixed[t][c], summed oldest first (the CPU order). taps are `ssm_conv1d`,
// channel c's `kernel` taps at c * kernel. `mixed` and `out` are the pass's rows; a run's are
// from its first row.
//
// Launch: grid = (ceil(channels / 128), the most rows of a run, n_runs), blockDim = 128;
// thread (c, t) of block z handles channel c of token t of run z.
extern "C" __global__ void gdn_conv(const float* __restrict__ mixed, const float* __restrict__ taps,
                                    const long long* __restrict__ runs, u64 plane_len,
                                    u64 layer_offset, int n_planes, int kernel, int channels,
                                    float* __restrict__ out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    const GdnRun run = gdn_run(runs, blockIdx.z);
    if (c >= channels || t >= run.rows) {
        return;
    }
    const int history = kernel - 1;
    const float* state = run.planes + (u64)run.start_plane * plane_len + layer_offset;
    const int first = run.write_plane >= 0 ? run.write_plane : run.start_plane + 1;
    const int written = (first + t) % n_planes;
    float* next = run.planes + (u64)written * plane_len + layer_offset;
    const float* w = taps + (u64)c * kernel;
    const float* inputs = mixed + (u64)run.first * channels;
    float acc = 0.0f;
    for (int i = 0; i < kernel; ++i) {
        // Window row i of token t is input number t + i of [state rows..., mixed rows...].
        const int k = t + i;
        const float value = k < history ? state[(u64)k * channels + c]
                                        : inputs[(u64)(k - history) * channels + c];
        acc = fmaf(value, w[i], acc);
        if (i > 0) {
            next[(u64)(i - 1) * channels + c] = value;
        }
    }
    out[(u64)(run.first + t) * channels + c] = silu_f(acc);
}
