"""Writes llama-cpp-greedy.json: llama.cpp's greedy continuations of fixed prompts on the
shared models, for the parity test plugins/cpu-simd/tests/llama_cpp.rs. The prompts are this
project's; the continuations are llama.cpp's.

Usage: python3 make_llama_cpp_greedy.py LLAMA_CPP_GREEDY SHARED_DIR > llama-cpp-greedy.json
(LLAMA_CPP_GREEDY: llama_cpp_greedy.cpp of this directory, built against llama.cpp commit
34af94cd as its header says.)
"""

import json
import subprocess
import sys

MODELS = [
    "models/next-arch/tiny-qwen2.gguf",
    "models/fixtures/tiny-llama.gguf",
    "models/stories260K.gguf",
    "models/llama2xs-281K.gguf",
    "models/fixtures/tiny-qwen35.gguf",
    "models/fixtures/tiny-qwen3next.gguf",
]

PROMPTS = [
    [1, 300, 301],
    [1, 50, 60, 70, 80, 90],
    [1, 400, 12, 250, 33],
    [1] + list(range(7, 26)),
]

N_PREDICT = 32


def main():
    tool, shared = sys.argv[1], sys.argv[2]
    cases = []
    for model in MODELS:
        for prompt in PROMPTS:
            out = subprocess.run(
                [tool, f"{shared}/{model}", str(N_PREDICT)] + [str(t) for t in prompt],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            cases.append(
                {"model": model, "prompt": prompt, "greedy": [int(t) for t in out.split()]}
            )
    json.dump({"llama_cpp_commit": "34af94cd", "cases": cases}, sys.stdout, indent=1)
    print()


main()
