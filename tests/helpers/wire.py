"""Agent metadata built field by field (csrc/transport/metadata.h), for tests that forge it.

Wire format, little-endian:
  "KVMV" | u16 version | u16 reserved | u32 body_nbytes | body | u64 xxh64(body)
"""

from __future__ import annotations

import struct
from typing import Any

from kvmove import _C

HEADER = struct.Struct("<4sHHI")
# (field, struct format); blobs are (length format, bytes).
BODY_FIELDS = [
    ("name", "B*"), ("incarnation", "I"), ("started_ns", "Q"), ("worker_address", "I*"),
    ("region_addr", "Q"),
    ("region_nbytes", "Q"),
    ("packed_rkey", "I*"), ("num_layers", "I"), ("num_blocks", "I"), ("block_nbytes", "Q"),
    ("num_kv_heads", "I"), ("head_dim", "I"), ("block_size", "I"), ("dtype", "B*"),
]


def parse(blob: bytes) -> dict[str, Any]:
    """The fields of a valid blob (a test-side decoder; test_agent_errors.py checks it
    against the library by a round trip)."""
    magic, version, reserved, body_nbytes = HEADER.unpack_from(blob)
    body = blob[HEADER.size:HEADER.size + body_nbytes]
    fields: dict[str, Any] = {"version": version, "reserved": reserved}
    pos = 0
    for name, fmt in BODY_FIELDS:
        (value,) = struct.unpack_from("<" + fmt.rstrip("*"), body, pos)
        pos += struct.calcsize(fmt.rstrip("*"))
        if fmt.endswith("*"):
            value, pos = body[pos:pos + value], pos + value
        fields[name] = value
    assert pos == len(body)
    return fields


def build(fields: dict[str, Any], body_suffix: bytes = b"") -> bytes:
    """A blob of ``fields`` with a correct checksum (so only the field checks can reject it)."""
    body = b""
    for name, fmt in BODY_FIELDS:
        value = fields[name]
        if fmt.endswith("*"):
            body += struct.pack("<" + fmt.rstrip("*"), len(value)) + value
        else:
            body += struct.pack("<" + fmt, value)
    body += body_suffix
    header = HEADER.pack(b"KVMV", fields["version"], fields["reserved"], len(body))
    return header + body + struct.pack("<Q", _C.xxh64(body, 0))
