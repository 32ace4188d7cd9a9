#!/usr/bin/env python3
"""Load-tests OpenAI-compatible completion servers side by side: Specula's `specula serve`,
llama.cpp's `llama-server`, or any other.

    scripts/serve-bench.py http://127.0.0.1:8080 http://127.0.0.1:8081 \
        [--model NAME] [--clients 1,4,8] [--requests 3] [--max-tokens 64] [--json]

For every server and every client count N, N clients each send `--requests` streaming greedy
completions one after another (different prompts per client). Reported per phase: aggregate
generated tokens per second (all tokens over the phase's wall time) and time to first token
(median and worst). Then a latency probe: a 64-token prompt alone, and again while 7 long
streams run (`--probe-streams`); the ratio is how much a busy server delays a new request.

Servers are measured in turns, phase by phase (A 1 client, B 1 client, A 4 clients, ...), so
drifting machine speed hits both alike. Python 3 standard library only.
"""

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The history of the city begins with",
    "Here is a short story about a robot who learns to paint:",
    "In the morning the market was full of people, and",
    "The recipe needs three things:",
    "She opened the old letter and read",
    "A list of facts about the moon:",
    "The train left the station at noon. On board were",
]

# About 64 tokens for common tokenizers.
PROBE_PROMPT = (
    "The committee met on a cold Tuesday morning to discuss the plans for the new library. "
    "Everyone agreed that the old building was too small, but nobody could agree on where the "
    "new one should stand, how large it should be, or who would pay for the work. After two "
    "hours of talk, the chair said"
)


def complete(base, model, prompt, max_tokens, timeout):
    """One streaming greedy completion: (time to first text, generated tokens, seconds)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    request = urllib.request.Request(
        base.rstrip("/") + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first = None
    pieces = 0
    usage = None
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    pieces += 1
                    if first is None:
                        first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    tokens = usage["completion_tokens"] if usage and "completion_tokens" in usage else pieces
    return (first if first is not None else seconds), tokens, seconds


COUNTER = [0]
COUNTER_LOCK = threading.Lock()


def fresh(prompt, unique):
    """`prompt`, made unlike any earlier one with `unique` (no server's prompt cache helps)."""
    if not unique:
        return prompt
    with COUNTER_LOCK:
        COUNTER[0] += 1
        return f"Request {COUNTER[0]}. {prompt}"


def phase(base, model, clients, requests, max_tokens, timeout, unique=False):
    """N clients, each sending `requests` completions in turn."""
    results, errors = [], []
    lock = threading.Lock()

    def client(c):
        for r in range(requests):
            prompt = fresh(PROMPTS[(c + r * clients) % len(PROMPTS)], unique)
            try:
                outcome = complete(base, model, prompt, max_tokens, timeout)
            except (OSError, urllib.error.URLError, ValueError) as e:
                with lock:
                    errors.append(str(e))
                return
            with lock:
                results.append(outcome)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = sorted(r[0] for r in results) or [float("nan")]
    tokens = sum(r[1] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": errors,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "ttft_median": statistics.median(ttft),
        "ttft_max": ttft[-1],
    }


def probe(base, model, streams, tries, timeout, unique=False):
    """TTFT of a 64-token prompt alone, then while `streams` long streams run."""
    idle = [
        complete(base, model, fresh(PROBE_PROMPT, unique), 1, timeout)[0] for _ in range(tries)
    ]
    stop = threading.Event()

    def background(c):
        while not stop.is_set():
            try:
                complete(base, model, PROMPTS[c % len(PROMPTS)], 256, timeout)
            except (OSError, urllib.error.URLError, ValueError):
                return

    threads = [threading.Thread(target=background, args=(c,)) for c in range(streams)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the streams are decoding
    busy = []
    for _ in range(tries):
        busy.append(complete(base, model, fresh(PROBE_PROMPT, unique), 1, timeout)[0])
        time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    idle_m, busy_m = statistics.median(idle), statistics.median(busy)
    return {
        "streams": streams,
        "ttft_idle_median": idle_m,
        "ttft_busy_median": busy_m,
        "ratio": busy_m / idle_m if idle_m > 0 else float("nan"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", nargs="+", help="base URLs, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", default="", help="the `model` field to send (default: none)")
    parser.add_argument("--clients", default="1,4,8", help="client counts (default 1,4,8)")
    parser.add_argument("--requests", type=int, default=3, help="completions per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--probe-streams", type=int, default=7, help="0 skips the probe")
    parser.add_argument("--probe-tries", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--unique",
        action="store_true",
        help="start every prompt with its own request number, so that no server's prompt cache "
        "serves a repeated prompt (llama-server reuses a slot's previous prompt token by token)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",") if c.strip()]

    report = {url: {"phases": [], "probe": None} for url in args.urls}
    for url in args.urls:  # warm-up: load pages, fill caches
        complete(url, args.model, PROMPTS[0], 8, args.timeout)
    for n in counts:
        for url in args.urls:
            report[url]["phases"].append(
                phase(
                    url, args.model, n, args.requests, args.max_tokens, args.timeout, args.unique
                )
            )
    if args.probe_streams > 0:
        for url in args.urls:
            report[url]["probe"] = probe(
                url, args.model, args.probe_streams, args.probe_tries, args.timeout, args.unique
            )

    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{'server':40} {'clients':>7} {'t/s':>8} {'ttft med':>9} {'ttft max':>9} {'errors':>6}")
    for n_index, n in enumerate(counts):
        for url in args.urls:
            p = report[url]["phases"][n_index]
            print(
                f"{url:40} {n:>7} {p['tokens_per_second']:>8.1f} {p['ttft_median']:>8.3f}s"
                f" {p['ttft_max']:>8.3f}s {len(p['errors']):>6}"
            )
    for url in args.urls:
        p = report[url]["probe"]
        if p:
            print(
                f"{url}: 64-token prompt, time to first token {p['ttft_idle_median']:.3f}s idle, "
                f"{p['ttft_busy_median']:.3f}s beside {p['streams']} streams "
                f"({p['ratio']:.2f}x)"
            )
    failed = any(p["errors"] for r in report.values() for p in r["phases"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
