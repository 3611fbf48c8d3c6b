"""The router's workers (``kvmove/serve/pool.py``): who is taking requests, what a pool
amounts to, and which worker it would give up, from the workers' flags and last stats alone
(no process is started)."""

from __future__ import annotations

import pytest

from kvmove.engine.role import Role
from kvmove.errors import KVMoveError
from kvmove.serve.config import ServeConfig
from kvmove.serve.messages import Stats
from kvmove.serve.planner import PoolSample
from kvmove.serve.pool import WorkerPool
from kvmove.serve.workers import WorkerInfo

CONFIG = ServeConfig(mode="disagg", num_blocks=100, max_num_seqs=10)


def _stats(free_blocks: int = 100, waiting: int = 0, running: int = 0,
           loading: int = 0) -> Stats:
    return Stats(free_blocks=free_blocks, waiting=waiting, running=running, loading=loading,
                 sending=0, store=None, agent=None, faults=None, notifications_dropped=0)


def _worker(name: str, role: Role, **flags: object) -> WorkerInfo:
    """A worker that registered (its agent listens) and is alive unless ``flags`` say not."""
    flags = {"alive": True, "registered": True, "identity": name.encode(), **flags}
    return WorkerInfo(name, role, [], **flags)


def _pool(*workers: WorkerInfo, config: ServeConfig = CONFIG) -> WorkerPool:
    pool = WorkerPool(config)
    for worker in workers:
        pool.add(worker)
    return pool


def test_members_are_filtered_by_role_and_flags() -> None:
    ready = _worker("decode-0", Role.DECODE, ready=True)
    draining = _worker("decode-1", Role.DECODE, draining=True)
    dead = _worker("decode-2", Role.DECODE, alive=False, retired=True)
    prefill = _worker("prefill-0", Role.PREFILL, ready=True)
    pool = _pool(ready, draining, dead, prefill)
    assert pool.members(Role.DECODE) == [ready, draining, dead]
    assert pool.alive(Role.DECODE) == [ready, draining]
    assert pool.alive() == [ready, draining, prefill]
    assert pool.ready(Role.DECODE) == [ready]
    assert pool.active(Role.DECODE) == [ready]
    assert pool.current() == [ready, draining, prefill]
    assert list(pool) == ["decode-0", "decode-1", "decode-2", "prefill-0"]


def test_a_message_is_attributed_to_a_live_worker_by_its_current_identity() -> None:
    live, dead = _worker("decode-0", Role.DECODE), _worker("decode-1", Role.DECODE, alive=False)
    pool = _pool(live, dead)
    assert pool.identify(b"decode-0") is live
    assert pool.identify(b"decode-1") is None  # a dead process's last words
    assert pool.identify(b"worker-0") is None


def test_a_name_is_taken_once() -> None:
    pool = _pool(_worker("decode-0", Role.DECODE), _worker("decode-2", Role.DECODE))
    assert pool.next_name(Role.DECODE) == "decode-1"
    assert pool.next_name(Role.PREFILL) == "prefill-0"
    with pytest.raises(KVMoveError, match="'decode-0' is in the pool already"):
        pool.add(_worker("decode-0", Role.DECODE))


def test_disaggregated_a_worker_is_ready_once_a_peer_of_the_other_pool() -> None:
    decode, prefill = _worker("decode-0", Role.DECODE), _worker("prefill-0", Role.PREFILL)
    pool = _pool(decode, prefill)
    pool.update_ready()
    assert not decode.ready and not prefill.ready
    decode.peers.add(("prefill-0", None))  # the process handles are fakes: pid None
    pool.update_ready()
    assert decode.ready and not prefill.ready
    prefill.draining = True
    pool.update_ready()
    assert not prefill.ready and decode.ready  # a draining worker is no one's peer to wait for
    colocated = _worker("worker-0", Role.COLOCATED)
    _pool(colocated, config=ServeConfig(mode="colocated")).update_ready()
    assert colocated.ready


def test_the_decode_sample_counts_requests_waiting_for_blocks_and_its_fullest_share() -> None:
    decode = [_worker("decode-0", Role.DECODE, stats=_stats(free_blocks=20, running=2)),
              _worker("decode-1", Role.DECODE, stats=_stats(waiting=3, running=6)),
              _worker("decode-2", Role.DECODE, stats=_stats(waiting=9), draining=True)]
    pool = _pool(*decode, _worker("prefill-0", Role.PREFILL, stats=_stats(waiting=5)))
    pool.waiting_for_blocks = 4
    # used: max(1 - 20/100, 2/10) = 0.8 and max(0, 6/10) = 0.6; the draining one is out
    assert pool.sample(Role.DECODE) == PoolSample(2, 3 + 4, 8, pytest.approx(0.7), 10)
    assert pool.sample(Role.PREFILL) == PoolSample(1, 5, 0, 0.0, 10)
    assert pool.queue(Role.DECODE) == 3 + 9 + 4  # the gauge counts every live worker's
    assert pool.queue(Role.PREFILL) == 5


def test_the_worker_to_drain_is_the_least_loaded_of_two_or_more() -> None:
    busy = _worker("decode-0", Role.DECODE, requests={"a", "b"})
    idle = _worker("decode-1", Role.DECODE, requests={"c"})
    pool = _pool(busy, idle, _worker("decode-2", Role.DECODE, draining=True))
    assert pool.to_drain(Role.DECODE) is idle
    idle.draining = True
    assert pool.to_drain(Role.DECODE) is None  # one left taking requests: none to spare


def test_health_is_degraded_while_each_role_has_a_live_worker() -> None:
    decode = [_worker("decode-0", Role.DECODE), _worker("decode-1", Role.DECODE)]
    prefill = _worker("prefill-0", Role.PREFILL)
    pool = _pool(*decode, prefill)
    assert pool.health()["status"] == "ok"
    decode[0].alive = False
    assert pool.health()["status"] == "degraded"
    decode[0].retired = True  # drained and ended: no longer reported
    assert pool.health()["status"] == "ok"
    assert [w["name"] for w in pool.health()["workers"]] == ["decode-1", "prefill-0"]
    prefill.alive = False
    assert pool.health() | {"workers": []} == {"status": "down", "mode": "disagg",
                                               "workers": []}


def test_health_is_degraded_while_a_worker_has_lost_a_peer() -> None:
    """A decode worker cut off from its prefill serves no hand-off until they connect again:
    ``/health`` does not say ok meanwhile (it did: issue 28, row 1)."""
    decode, prefill = _worker("decode-0", Role.DECODE), _worker("prefill-0", Role.PREFILL)
    pool = _pool(decode, prefill)
    decode.stats = Stats(free_blocks=8, waiting=0, running=0, loading=0, sending=0, store=None,
                         agent=None, faults=None, notifications_dropped=0)
    assert pool.health()["status"] == "ok"
    decode.stats = decode.stats.model_copy(update={"lost_peers": ["prefill-0"]})
    health = pool.health()
    assert health["status"] == "degraded"
    assert health["workers"][0]["lost_peers"] == ["prefill-0"]
    prefill.alive = prefill.ready = False
    prefill.retired = True  # drained and ended: a peer lost for good is no fault of decode-0
    assert pool.health()["status"] == "ok"


def test_blocks_taken_since_the_last_stats_count_against_a_decode_worker() -> None:
    """A burst of reservations between two stats spreads: each one's blocks count at once
    (asked: the router's estimate; granted: the worker's count), until stats show them."""
    first, second = _worker("decode-0", Role.DECODE), _worker("decode-1", Role.DECODE)
    first.reported(_stats(free_blocks=100))
    second.reported(_stats(free_blocks=99))
    assert max((first, second), key=lambda w: w.free_blocks) is first
    first.asked_blocks["a"] = 2
    assert first.free_blocks == 98
    assert max((first, second), key=lambda w: w.free_blocks) is second
    del first.asked_blocks["a"]  # the grant came: 3 blocks (the estimate was 2)
    first.granted_blocks += 3
    assert first.free_blocks == 97
    first.reported(_stats(free_blocks=97))  # stats that count them
    assert (first.free_blocks, first.granted_blocks) == (97, 0)


def test_net_devices_reach_each_workers_agent() -> None:
    """``kvmove-serve --net-devices`` (an RDMA host's devices) is on every worker's command
    line, and the worker's parser takes it for its agent; absent, the agent's default."""
    from kvmove.serve import cli, worker_main
    from kvmove.serve.workers import worker_command

    args = cli._parser().parse_args(["--net-devices", "mlx5_0:1"])
    assert args.net_devices == "mlx5_0:1"
    command = worker_command(ServeConfig(net_devices="mlx5_0:1"), "worker-0", Role.COLOCATED,
                             [], "ipc://x")
    assert command[command.index("--net-devices") + 1] == "mlx5_0:1"
    parsed = worker_main._parser().parse_args(command[command.index("--name"):])
    assert parsed.net_devices == "mlx5_0:1"
    assert "--net-devices" not in worker_command(ServeConfig(), "worker-0", Role.COLOCATED, [],
                                                 "ipc://x")
