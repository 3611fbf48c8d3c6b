"""Far side of the transfer tests: a KVCache + Agent in another process, driven over a Pipe.

Two ways to run it:

* ``multiprocessing`` (spawn) target :func:`serve`, wrapped by :class:`FarPeer` in the test
  process. Spawn re-imports this module by name in the child, so ``tests/`` must be on
  ``sys.path`` when the child starts; spawn copies the parent's ``sys.path`` into the child,
  and ``tests/conftest.py`` puts ``tests/`` there.
* a script (``python tests/helpers/far.py send|receive ...``), for ``test_two_hosts.py``, which runs
  one agent per network namespace under ``ip netns exec``.

Nothing here mocks the data path: every byte moves through ``kvmove.Agent`` and UCX.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import numpy as np

# A child with no command for this long assumes its parent is wedged and exits.
IDLE_EXIT_SECONDS = 300.0


# ---------------------------------------------------------------------------------------------
# Reference data, identical in every process.

def pattern(seed: int, num_layers: int, num_blocks: int, block_nbytes: int) -> np.ndarray:
    """Random bytes ``[L, N, block_nbytes]`` (uint8) determined by ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_layers, num_blocks, block_nbytes), dtype=np.uint8)


def raw_view(cache: Any) -> np.ndarray:
    """The cache's bytes as a writable zero-copy uint8 view ``[L, N, block_nbytes]``."""
    view = cache.numpy()
    return view.view(np.uint8).reshape(view.shape[0], view.shape[1], -1)


def fill(cache: Any, seed: int) -> np.ndarray:
    """Overwrite the whole cache with ``pattern(seed)``; returns a copy of what was written."""
    raw = raw_view(cache)
    data = pattern(seed, *raw.shape)
    raw[...] = data
    return data


def sha256(cache: Any) -> str:
    return hashlib.sha256(raw_view(cache).tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# The far agent, served over a Pipe.

class _Far:
    """Commands the parent can run in the child; each returns a picklable value."""

    def __init__(self, name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict):
        import kvmove

        self.kvmove = kvmove
        self.cache = kvmove.KVCache(kvmove.KVLayout(**layout_kwargs), num_blocks)
        self.agent = kvmove.Agent(name, self.cache, **agent_kwargs)
        self.transfers: list[Any] = []

    def close(self) -> None:
        self.agent.close()

    def pid(self) -> int:
        return os.getpid()

    def fill(self, seed: int) -> None:
        fill(self.cache, seed)

    def snapshot(self) -> np.ndarray:
        return raw_view(self.cache).copy()

    def listen(self, host: str = "127.0.0.1") -> tuple[str, int]:
        return tuple(self.agent.listen(host))

    def connect(self, host: str, port: int) -> str:
        return self.agent.connect(host, port)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def remove_peer(self, name: str) -> None:
        self.agent.remove_peer(name)

    def peers(self) -> list[str]:
        return list(self.agent.peers)

    def notifications(self) -> list[tuple[str, bytes]]:
        return [(str(n), bytes(p)) for n, p in self.agent.notifications()]

    def wait_notification(self, timeout: float) -> tuple[str, bytes]:
        name, payload = self.agent.wait_notification(timeout)
        return str(name), bytes(payload)

    def wait_notification_and_gather(self, timeout: float, block_ids: list[int],
                                     layers: list[int] | None = None) -> tuple[str, bytes, Any]:
        """Waits for a notification and copies ``block_ids`` (in ``layers``) the instant it
        arrives, before anything else can change them: ``[len(layers), len(ids), nbytes]``."""
        name, payload = self.agent.wait_notification(timeout)
        raw = raw_view(self.cache)
        rows = raw if layers is None else raw[layers]
        return str(name), bytes(payload), rows[:, block_ids].copy()

    def write(self, peer: str, local_ids: list[int], remote_ids: list[int],
              layers: list[int] | None = None, notify: bytes | None = None,
              timeout: float = 10.0) -> dict:
        t = self.agent.write(peer, local_ids, remote_ids, layers=layers, notify=notify)
        t.wait(timeout)
        return _stats(t)

    def write_many(self, peer: str, batches: list[tuple[list[int], list[int], bytes]],
                   timeout: float = 10.0) -> None:
        """Posts every batch before waiting on any (each with its notify payload)."""
        posted = [self.agent.write(peer, l, r, notify=n) for l, r, n in batches]
        for t in posted:
            t.wait(timeout)


def _stats(t: Any) -> dict:
    s = t.stats
    return {"nbytes": s.nbytes, "num_ops": s.num_ops, "post_seconds": s.post_seconds,
            "complete_seconds": s.complete_seconds, "state": str(t.state), "error": t.error}


def serve(conn: Any, name: str, layout_kwargs: dict, num_blocks: int,
          agent_kwargs: dict) -> None:
    """Child main loop around a :class:`_Far`."""
    serve_far(conn, _Far, name, layout_kwargs, num_blocks, agent_kwargs)


def serve_far(conn: Any, make: Any, *args: Any) -> None:
    """Child main loop around ``make(*args)``: ``(command, args)`` in, ``("ok", result)`` or
    ``("err", type, msg)`` out; ``None`` (or the parent going away) ends it and closes it."""
    try:
        far = make(*args)
    except BaseException as e:  # report start-up failures instead of dying silently
        conn.send(("err", type(e).__name__, str(e)))
        return
    conn.send(("ok", None))
    try:
        while conn.poll(IDLE_EXIT_SECONDS):
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            command, args = msg
            try:
                conn.send(("ok", getattr(far, command)(*args)))
            except Exception as e:
                conn.send(("err", type(e).__name__, str(e)))
    finally:
        far.close()
        conn.close()


class FarError(Exception):
    """An exception raised in the far process: ``kind`` is its class name."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class FarPeer:
    """Parent-side handle of a :func:`serve` child. Every call has a deadline; ``stop()``
    always leaves the child dead and joined."""

    def __init__(self, name: str, layout_kwargs: dict, num_blocks: int, agent_kwargs: dict,
                 start_timeout: float = 30.0, target: Any = None, extra: tuple = ()):
        """``target(conn, name, layout_kwargs, num_blocks, agent_kwargs, *extra)`` runs in
        the child (default :func:`serve`)."""
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=target or serve, name=f"far-{name}", daemon=True,
                                   args=(child_conn, name, layout_kwargs, num_blocks,
                                         agent_kwargs, *extra))
        self.process.start()
        child_conn.close()
        try:
            self._reply(start_timeout, "start")
        except BaseException:
            self.stop()
            raise

    def call(self, command: str, *args: Any, timeout: float = 30.0) -> Any:
        self.conn.send((command, args))
        return self._reply(timeout, command)

    def _reply(self, timeout: float, command: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"far process {self.name!r} died during {command!r} "
                                   f"(exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"far process {self.name!r} did not answer {command!r} "
                                   f"within {timeout} s")
        status, *rest = self.conn.recv()
        if status == "err":
            raise FarError(*rest)
        return rest[0]

    def pause(self) -> None:
        """SIGSTOP the far process: its UCX progress thread stops too."""
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            try:
                self.resume()
                self.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self.conn.close()


# ---------------------------------------------------------------------------------------------
# Script mode for test_two_hosts.py: one agent per network namespace.

def _script_cache(args: argparse.Namespace) -> Any:
    import kvmove

    layout = kvmove.KVLayout(num_layers=args.layers, num_kv_heads=args.heads,
                             head_dim=args.head_dim, dtype="float16",
                             block_size=args.block_size)
    return kvmove.KVCache(layout, args.blocks)


def _receive(args: argparse.Namespace) -> int:
    """Listen on ``host:port``, say READY, wait for the sender's notification, print the sha256
    of the whole cache."""
    import kvmove

    cache = _script_cache(args)
    with kvmove.Agent("host-b", cache, transports="tcp", error_mode="peer") as agent:
        host, port = agent.listen(args.host, args.port)
        print(f"READY {host} {port}", flush=True)
        sender, payload = agent.wait_notification(args.timeout)
        print(f"NOTIFY {sender} {bytes(payload).decode()}", flush=True)
        print(f"PEERS {','.join(agent.peers)}", flush=True)
        print(f"SHA256 {sha256(cache)}", flush=True)
    return 0


def _send(args: argparse.Namespace) -> int:
    """Fill the cache with ``pattern(seed)``, connect to the receiver, write blocks
    ``0..n-1`` to ``remote_ids``, notify, print the transfer stats."""
    import kvmove

    cache = _script_cache(args)
    fill(cache, args.seed)
    remote_ids = [int(x) for x in args.remote_ids.split(",")]
    with kvmove.Agent("host-a", cache, transports="tcp", error_mode="peer") as agent:
        peer = agent.connect(args.host, args.port, timeout=args.timeout)
        print(f"PEER {peer}", flush=True)
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
