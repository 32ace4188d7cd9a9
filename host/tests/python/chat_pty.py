"""`specula chat` in a pseudo-terminal: Ctrl-C stops the answer being written, not the
program, which then takes the next command.

Usage: python3 chat_pty.py SPECULA MODEL. Exits non-zero, printing the transcript, on failure.
"""

import os
import pty
import select
import sys
import time


def main() -> None:
    specula, model = sys.argv[1], sys.argv[2]
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(specula, [specula, "chat", "-m", model, "--temp", "0", "-n", "100000", "-t", "1"])
    transcript = b""

    seen = 0  # where the next `read_until` starts looking

    def read_until(needle: bytes, timeout: float) -> bool:
        nonlocal transcript, seen
        deadline = time.time() + timeout
        while True:
            at = transcript.find(needle, seen)
            if at >= 0:
                seen = at + len(needle)
                return True
            if time.time() >= deadline:
                return False
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    return transcript.find(needle, seen) >= 0
                if not chunk:
                    return transcript.find(needle, seen) >= 0
                transcript += chunk

    def fail(why: str) -> None:
        sys.stdout.write(transcript.decode(errors="replace"))
        sys.exit(f"chat_pty: {why}")

    if not read_until(b"> ", 60):
        fail("no prompt")
    start = len(transcript)
    os.write(fd, b"Once upon a time\n")
    # Let it write for a moment, then Ctrl-C.
    deadline = time.time() + 30
    while len(transcript) < start + 200 and time.time() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            transcript += os.read(fd, 4096)
    if len(transcript) < start + 200:
        fail("no answer being written")
    os.write(fd, b"\x03")
    if not read_until(b"[stopped]", 20):
        fail("Ctrl-C did not stop the answer")
    if not read_until(b"> ", 10):
        fail("no prompt after the stopped answer")
    os.write(fd, b"/stats\n")
    if not read_until(b"turns: 1", 10):
        fail("/stats did not answer after Ctrl-C")
    os.write(fd, b"/exit\n")
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        fail(f"exit status {status}")
    print("chat_pty: ok")


if __name__ == "__main__":
    main()
