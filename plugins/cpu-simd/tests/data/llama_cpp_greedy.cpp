// Prints llama.cpp's greedy continuation of a prompt, as token ids, for the parity test
// (plugins/cpu-simd/tests/llama_cpp.rs). The program is this project's; it only calls
// llama.cpp's public C API (llama.h of commit 34af94cd, built with
// ../shared/tools/build-llama-peer.sh).
//
//   llama_cpp_greedy MODEL N_PREDICT TOKEN...
//
// Prints the N_PREDICT ids chosen by argmax (no EOS stop: the test compares every position),
// space-separated, on one line. Build (BUILD: the peer's build directory, SRC its source):
//   g++ -O2 -std=c++17 llama_cpp_greedy.cpp -I$SRC/include -I$SRC/ggml/include \
//       -L$BUILD/bin -lllama -lggml -lggml-base -Wl,-rpath,$BUILD/bin -o llama_cpp_greedy
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

static void quiet(enum ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s MODEL N_PREDICT TOKEN...\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    const int n_predict = std::atoi(argv[2]);
    std::vector<llama_token> prompt;
    for (int i = 3; i < argc; i++) {
        prompt.push_back(std::atoi(argv[i]));
    }
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = prompt.size() + n_predict + 8;
    cp.n_batch = cp.n_ctx;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    llama_context * ctx = llama_init_from_model(model, cp);
    llama_sampler * greedy = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(greedy, llama_sampler_init_greedy());

    llama_batch batch = llama_batch_get_one(prompt.data(), prompt.size());
    llama_token next = 0;
    for (int i = 0; i < n_predict; i++) {
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed at step %d\n", i);
            return 1;
        }
        next = llama_sampler_sample(greedy, ctx, -1);
        std::printf(i == 0 ? "%d" : " %d", next);
        batch = llama_batch_get_one(&next, 1);
    }
    std::printf("\n");
    llama_sampler_free(greedy);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
