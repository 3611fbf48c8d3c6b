"""One agent of ``test_two_hosts.py``, run as a script in a network namespace (``ip netns
exec``): ``python -m helpers.two_hosts send|receive ...`` from ``tests/``.

The receiver serves on ``--host`` (UCX and the metadata listener), says READY, waits for the
sender's notification and prints the sha256 of its whole cache and the addresses its sockets
listen on; the sender serves on ``--bind``, fills its cache with ``pattern(seed)``, connects,
writes its blocks ``0..n-1`` to ``--remote-ids`` with a notification and prints the
path the peer is reached by (``Agent.peer_path``) and the transfer's stats. Both take the
deployment key from ``KVMOVE_KEY``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import kvmove

from helpers.checks import listening_addresses
from helpers.kv import fill, sha256


def _script_cache(args: argparse.Namespace) -> Any:
    layout = kvmove.KVSpec(num_layers=args.layers, num_kv_heads=args.heads,
                             head_dim=args.head_dim, dtype="float16",
                             block_size=args.block_size)
    return kvmove.KVCache(layout, args.blocks)


def _receive(args: argparse.Namespace) -> int:
    """Listen on ``host:port``, say READY, wait for the sender's notification, print the sha256
    of the whole cache."""
    cache = _script_cache(args)
    with kvmove.Agent("host-b", cache, transports="tcp", error_mode="peer",
                      host=args.host) as agent:
        host, port = agent.listen(port=args.port)
        print(f"READY {host} {port}", flush=True)
        sender, payload = agent.wait_notification(args.timeout)
        print(f"NOTIFY {sender} {bytes(payload).decode()}", flush=True)
        print(f"PEERS {','.join(agent.peers)}", flush=True)
        print(f"SHA256 {sha256(cache)}", flush=True)
        hosts = sorted({host for host, _ in listening_addresses()})
        print(f"LISTENING {','.join(hosts)}", flush=True)
    return 0


def _send(args: argparse.Namespace) -> int:
    """Fill the cache with ``pattern(seed)``, connect to the receiver, write blocks
    ``0..n-1`` to ``remote_ids``, notify, print the transfer stats."""
    cache = _script_cache(args)
    fill(cache, args.seed)
    remote_ids = [int(x) for x in args.remote_ids.split(",")]
    with kvmove.Agent("host-a", cache, transports="tcp", error_mode="peer",
                      host=args.bind) as agent:
        peer = agent.connect(args.host, args.port, timeout=args.timeout)
        print(f"PEER {peer}", flush=True)
        print(f"PATH {agent.peer_path(peer)}", flush=True)  # another netns: never "mapped"
        t = agent.write(peer, list(range(len(remote_ids))), remote_ids, notify=b"two-hosts")
        t.wait(args.timeout)
        print(f"STATE {t.state}", flush=True)
        print(f"NBYTES {t.stats.nbytes}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["send", "receive"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bind", help="the sender's own address")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--remote-ids", default="")
    parser.add_argument("--timeout", type=float, default=15.0)
    args = parser.parse_args(argv)
    return _receive(args) if args.role == "receive" else _send(args)


if __name__ == "__main__":
    sys.exit(main())
