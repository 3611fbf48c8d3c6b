"""Where a process's threads may run, read from /proc."""

from __future__ import annotations

import os


def cpus_of_threads(pid: int | str = "self") -> dict[int, set[int]]:
    """Thread id -> the CPUs it may run on, for every thread of process ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                line = next(s for s in status if s.startswith("Cpus_allowed_list:"))
        except FileNotFoundError:  # the thread exited meanwhile
            continue
        out[int(tid)] = parse_cpu_list(line.split(":", 1)[1].strip())
    return out


def parse_cpu_list(text: str) -> set[int]:
    """``0-2,5`` -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus
