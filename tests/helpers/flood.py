"""A keyless flood of a metadata listener, as a process of its own (issue 28, row 3):

    python tests/helpers/flood.py HOST PORT

sends wrongly signed requests (the signature's magic, then zeros: each costs the listener a
whole HMAC) from ``SOCKETS`` DEALER sockets, as fast as the listener takes them, never
reading an answer. It prints ``flooding`` once the first messages are out; once a line
arrives on stdin (or ``MAX_SECONDS`` have passed) it stops and prints the number it sent,
then holds its connections open until stdin ends: ZeroMQ drops what a connection still
queues when it closes, so the listener can count every message only while they are open.

"""

from __future__ import annotations

import select
import sys
import time

import zmq

SOCKETS = 8
BATCH = 256  # messages sent between two looks at stdin
MAX_SECONDS = 120.0
JUNK = b"KVMS" + bytes(200)
SEND_MS = 100  # a send waits this long for room, then the loop moves on


def stop_asked() -> bool:
    return bool(select.select([sys.stdin], [], [], 0)[0])


def main(host: str, port: int) -> int:
    ctx = zmq.Context()
    socks = []
    for _ in range(SOCKETS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, SEND_MS)
        sock.connect(f"tcp://{host}:{port}")
        socks.append(sock)
    sent, announced, deadline = 0, False, time.monotonic() + MAX_SECONDS
    try:
        while time.monotonic() < deadline and not stop_asked():
            for sock in socks:
                for _ in range(BATCH // SOCKETS):
                    try:
                        sock.send_multipart([b"", JUNK])
                        sent += 1
                    except zmq.Again:
                        break
            if not announced and sent:
                print("flooding", flush=True)
                announced = True
        print(sent, flush=True)
        sys.stdin.readline()
        sys.stdin.read()  # until EOF
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
