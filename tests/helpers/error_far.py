"""Spawn targets for ``test_agent_errors.py``: far agents that exist only to be killed.

Spawn re-imports this module by name in the child, so ``tests/`` must be on ``sys.path`` when
the child starts; spawn copies the parent's ``sys.path``, and ``tests/conftest.py`` puts
``tests/`` there. Nothing is mocked: the child is a real ``kvmove.Agent``.
"""

from __future__ import annotations

import os
from typing import Any

# A child whose parent never kills it (the parent itself died) exits after this long.
SLEEP_SECONDS = 120.0


def listen_then_sleep(conn: Any, name: str, layout_kwargs: dict, num_blocks: int,
                      agent_kwargs: dict) -> None:
    """Creates a ``KVCache`` and an ``Agent``, listens on loopback, sends
    ``("ok", pid, host, port)`` (or ``("err", message)``) through ``conn``, then sleeps until
    the parent sends anything, closes the pipe, or kills this process."""
    import kvmove

    try:
        cache = kvmove.KVCache(kvmove.KVLayout(**layout_kwargs), num_blocks)
        agent = kvmove.Agent(name, cache, **agent_kwargs)
    except BaseException as e:  # report start-up failures instead of dying silently
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    with agent:
        host, port = agent.listen()
        conn.send(("ok", os.getpid(), host, port))
        conn.poll(SLEEP_SECONDS)
    conn.close()
