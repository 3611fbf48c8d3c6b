"""Agent metadata built field by field (csrc/transport/metadata.h), for tests that forge it.

Wire format (version 5), little-endian:
  "KVMV" | u16 version | u16 reserved | u32 body_nbytes | body | u64 xxh64(body)
  body = name | incarnation | started_ns | worker_address | boot_id | netns_ino | pidns_ino
       | pid | u32 num_segments | segment*
       | num_layers | num_blocks | num_parts | plane* | num_kv_heads | head_dim | block_size
       | dtype | order | head_first | total_kv_heads

``parse`` gives the scalar fields by name, and ``segments`` / ``planes`` as lists of dicts
(``addr``, ``nbytes``, ``packed_rkey``, ``memfd``, ``memfd_dev``, ``memfd_ino`` / ``base``,
``block_stride``, ``block_nbytes``, ``segment``); ``build`` takes the same, so a test changes
one field of one record.
"""

from __future__ import annotations

import struct
from typing import Any

from kvmove import _C

HEADER = struct.Struct("<4sHHI")
# (field, struct format); blobs ("*") are (length format, bytes).
SEGMENT_FIELDS = [("addr", "Q"), ("nbytes", "Q"), ("packed_rkey", "I*"), ("memfd", "i"),
                  ("memfd_dev", "Q"), ("memfd_ino", "Q")]
PLANE_FIELDS = [("base", "Q"), ("block_stride", "Q"), ("block_nbytes", "Q"), ("segment", "I")]
BODY_FIELDS = [
    ("name", "B*"), ("incarnation", "I"), ("started_ns", "Q"), ("worker_address", "I*"),
    ("boot_id", "B*"), ("netns_ino", "Q"), ("pidns_ino", "Q"), ("pid", "I"),
    ("segments", SEGMENT_FIELDS),
    ("num_layers", "I"), ("num_blocks", "I"), ("num_parts", "I"),
    ("planes", PLANE_FIELDS),
    ("num_kv_heads", "I"), ("head_dim", "I"), ("block_size", "I"), ("dtype", "B*"),
    ("order", "B*"), ("head_first", "I"), ("total_kv_heads", "I"),
]


def _read(body: bytes, pos: int, fields: list[tuple[str, Any]],
          out: dict[str, Any]) -> int:
    for name, fmt in fields:
        if isinstance(fmt, list):  # records: a u32 count, except planes (layers x parts)
            if name == "segments":
                (count,) = struct.unpack_from("<I", body, pos)
                pos += 4
            else:
                count = out["num_layers"] * out["num_parts"]
            out[name] = []
            for _ in range(count):
                record: dict[str, Any] = {}
                pos = _read(body, pos, fmt, record)
                out[name].append(record)
            continue
        (value,) = struct.unpack_from("<" + fmt.rstrip("*"), body, pos)
        pos += struct.calcsize(fmt.rstrip("*"))
        if fmt.endswith("*"):
            value, pos = body[pos:pos + value], pos + value
        out[name] = value
    return pos


def _write(fields: list[tuple[str, Any]], values: dict[str, Any]) -> bytes:
    body = b""
    for name, fmt in fields:
        value = values[name]
        if isinstance(fmt, list):
            if name == "segments":
                body += struct.pack("<I", len(value))
            body += b"".join(_write(fmt, record) for record in value)
        elif fmt.endswith("*"):
            body += struct.pack("<" + fmt.rstrip("*"), len(value)) + value
        else:
            body += struct.pack("<" + fmt, value)
    return body


def parse(blob: bytes) -> dict[str, Any]:
    """The fields of a valid blob (a test-side decoder; test_agent_errors.py checks it
    against the library by a round trip)."""
    magic, version, reserved, body_nbytes = HEADER.unpack_from(blob)
    body = blob[HEADER.size:HEADER.size + body_nbytes]
    fields: dict[str, Any] = {"version": version, "reserved": reserved}
    pos = _read(body, 0, BODY_FIELDS, fields)
    assert pos == len(body)
    return fields


def build(fields: dict[str, Any], body_suffix: bytes = b"") -> bytes:
    """A blob of ``fields`` with a correct checksum (so only the field checks can reject it)."""
    body = _write(BODY_FIELDS, fields) + body_suffix
    header = HEADER.pack(b"KVMV", fields["version"], fields["reserved"], len(body))
    return header + body + struct.pack("<Q", _C.xxh64(body, 0))
