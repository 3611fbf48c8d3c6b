"""What one engine instance does with a request: its role.

* ``colocated``: prefill and decode in one batch;
* ``prefill``: computes prompts and hands each request's KV to a decode worker;
* ``decode``: takes the KV a prefill worker computed and generates.

A ``StrEnum``: each member is its wire string, so a role compares, hashes, formats and
serializes (command lines, control messages, metric labels, JSON) as the plain string it
replaced, and ``Role("prefill")`` turns a string from outside into one. Both the engine and
``kvmove-serve`` import it from here, which imports nothing of theirs.
"""

from __future__ import annotations

import enum

__all__ = ["ROLES", "Role"]


class Role(enum.StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


# The wire strings, in order: for argparse's ``choices`` and error messages, which show a
# tuple of strings as it always was (a tuple of members would show their reprs).
ROLES: tuple[str, ...] = tuple(role.value for role in Role)
