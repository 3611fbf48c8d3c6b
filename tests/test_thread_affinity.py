"""Where kvmove's threads run (``kvmove.runtime.unpinned``, csrc/common/cpu_mask.h).

An engine pins its model thread to its own cores; kvmove's threads must not share them, or
they move the KV only when the model thread gives its core up. An agent built inside
``unpinned()`` starts its progress thread on every CPU, and the threads it starts later, on
first use, from the pinned model thread (a stream's post thread on the first ``save_layer``,
the copy threads on the first mapped write) run there too, not on the model thread's core.

Each test pins this thread to one CPU, builds the agents unpinned, uses them from the pinned
thread, and reads every thread's ``Cpus_allowed_list`` in /proc/self/task: the threads that
appeared are allowed every CPU this process may use. Skipped on one CPU (nothing to pin).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

import kvmove
from kvmove.runtime import unpinned

from helpers.far import FarPeer
from helpers.kv import fill, make_cache
from helpers.serve import wait_until
from helpers.threads import cpus_of_threads

LAYOUT = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16", block_size=16)
NUM_BLOCKS = 64  # 64 KiB a block and layer: a write of many goes to the copy threads
WAIT = 10.0

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="one CPU: nothing to pin a thread away from")


EVERY = os.sched_getaffinity(0)  # this process's CPUs


@pytest.fixture
def pinned() -> Iterator[int]:
    """This thread on one CPU (the model's), for the test; every CPU again after it."""
    core = min(EVERY)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, EVERY)


def new_threads(before: dict[int, set[int]]) -> dict[int, set[int]]:
    return {tid: cpus for tid, cpus in cpus_of_threads().items() if tid not in before}


def test_unpinned_restores_the_callers_pin(pinned: int) -> None:
    with unpinned():
        assert len(os.sched_getaffinity(0)) > 1
    assert os.sched_getaffinity(0) == {pinned}


def test_an_unpinned_agents_threads_run_on_every_cpu(pinned: int) -> None:
    """The progress thread (started with the agent) and the post thread (started by the
    first save_layer, from the pinned thread) may run on every CPU; a thread started plainly
    from the pinned thread may not (the baseline: what the post thread inherited before)."""
    every = EVERY
    before = cpus_of_threads()
    a_cache, b_cache = make_cache(LAYOUT, 8), make_cache(LAYOUT, 8)
    fill(a_cache, 3)
    with unpinned():
        a = kvmove.Agent("a", a_cache, transports="tcp")
        b = kvmove.Agent("b", b_cache, transports="tcp")
    with a, b:
        assert a.add_peer(b.metadata()) == "b" and b.add_peer(a.metadata()) == "a"
        started = new_threads(before)
        assert len(started) >= 2, started  # a progress thread each
        assert all(cpus == every for cpus in started.values()), started
        before = cpus_of_threads()
        load = b.expect("a", "req", [1, 2]).start_load()
        stream = a.stream_to("b", [1, 2], [1, 2], "req", epoch=load.epoch)
        # once b said yes to the lease, save_layer queues from this thread (before, the
        # progress thread queues the layers saved so far when the answer comes)
        wait_until(lambda: stream._core.answered, WAIT, "b answers the lease")
        for layer in range(LAYOUT["num_layers"]):
            stream.save_layer(layer)  # from the pinned thread: starts the post thread
        stream.finish(b"x")
        assert load.wait_all(WAIT) == b"x"
        started = new_threads(before)
        assert started, "the first save_layer started no thread"
        assert all(cpus == every for cpus in started.values()), started
    baseline = threading.Thread(target=lambda: cpus_seen.append(os.sched_getaffinity(0)))
    cpus_seen: list[set[int]] = []
    baseline.start()
    baseline.join(WAIT)
    assert cpus_seen == [{pinned}]


def test_copy_threads_of_a_mapped_write_run_on_every_cpu(pinned: int) -> None:
    far = FarPeer("far", LAYOUT, NUM_BLOCKS, {})
    try:
        cache = make_cache(LAYOUT, NUM_BLOCKS)
        fill(cache, 5)
        with unpinned():
            near = kvmove.Agent("near", cache)
        with near:
            host, port = far.call("listen")
            peer = near.connect(host, port, timeout=WAIT)
            assert near.peer_path(peer) == "mapped"
            before = cpus_of_threads()
            ids = list(range(48))
            near.write(peer, ids, ids).wait(WAIT)  # 12 MiB: the copy threads, started now
            started = new_threads(before)
            assert started, "the first mapped write started no copy thread"
            assert all(cpus == EVERY for cpus in started.values()), started
    finally:
        far.stop()

