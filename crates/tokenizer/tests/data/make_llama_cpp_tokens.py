"""Writes llama-cpp-tokens.json: how llama.cpp's `llama-tokenize` splits tricky strings with
every vocabulary in ../shared/vocab and the tok512 model vocabulary, for the tokenizer parity
test (crates/tokenizer/tests/tokenizer.rs). The strings are this project's; the ids are llama.cpp's.

Usage: python3 make_llama_cpp_tokens.py LLAMA_TOKENIZE SHARED_DIR > llama-cpp-tokens.json
(LLAMA_TOKENIZE: a llama-tokenize binary built from llama.cpp commit 34af94cd with
../shared/tools/build-llama-peer.sh.)
"""

import json
import os
import subprocess
import sys
import tempfile

TEXTS = [
    "Hello world",
    " Hello world",
    "Hello world ",
    "  two leading spaces and two trailing  ",
    "\n",
    "\n\nparagraph\n\n\nbreaks\n",
    "tabs\tand\t\ttabs",
    "windows\r\nline\r\nends\r\n",
    " \t \r\n mixed whitespace \u00a0\u3000",
    "123 4567 89012 3.14159 -42 1e10 0x1F",
    "2026-11-24 12:34:56",
    "I'm you're they'll we've she'd IT'S",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 cafe\u0301 nai\u0308ve",
    "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "emoji \U0001F600\U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467 \U0001F1EF\U0001F1F5 \u2764\ufe0f",
    "rare \U00010348 \U0001D11E \u2603 \u00bd\u2153",
    "<s>",
    "</s>",
    "<s> text after a BOS text </s>",
    "<|endoftext|>",
    "text<|endoftext|>more text",
    "<|im_start|>user\nhi<|im_end|>",
    "<unk> <pad> <mask>",
    "def f(x):\n    return x ** 2  # square\n",
    "if (a && b) { return a[i] + b->c; }",
    "https://example.com/path?q=1&r=two#frag",
    "email: someone@example.org",
    "!!!???...,,,;;;:::",
    "----====____****",
    "\u00a9\u00ae\u2122 \u20ac100 \u00a3 \u00a5",
    "Once upon a time, there was a little girl named Lily.",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "\u0000\u0001\u007f controls",
    "   ",
    "",
]

def vocabularies(shared):
    vocab = os.path.join(shared, "vocab")
    out = [(name[len("ggml-vocab-"):-len(".gguf")], os.path.join(vocab, name))
           for name in sorted(os.listdir(vocab)) if name.endswith(".gguf")]
    out.append(("stories260K", os.path.join(shared, "models", "stories260K.gguf")))
    return out

def tokenize(binary, model, text, parse_special):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        args = [binary, "-m", model, "-f", path, "--ids", "--no-escape", "--log-disable"]
        if not parse_special:
            args.append("--no-parse-special")
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)

def main():
    binary, shared = sys.argv[1], sys.argv[2]
    cases = []
    for name, path in vocabularies(shared):
        for text in TEXTS:
            for parse_special in (False, True):
                cases.append({
                    "vocab": name,
                    "text": text,
                    "parse_special": parse_special,
                    "ids": tokenize(binary, path, text, parse_special),
                })
    json.dump({"llama.cpp": "34af94cd9ab277632e27caeec2d41de2fd091b31", "add_bos": "as the vocabulary says",
               "cases": cases}, sys.stdout, ensure_ascii=True, indent=None)
    sys.stdout.write("\n")

if __name__ == "__main__":
    main()
