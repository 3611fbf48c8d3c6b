"""Who may join: the deployment key, and the signature it puts on what agents exchange.

A peer is whoever holds the key (docs/security.md). An agent's metadata (how to reach its
memory: UCX address, region, remote key) is signed with HMAC-SHA256 under it, and
``Agent.add_peer`` checks the signature before one byte of the metadata reaches the core or
UCX: without the key, a forged, mutated or foreign blob is refused whatever it claims.

We sign rather than encrypt (CurveZMQ would do both for the ZeroMQ exchange) because the
signature travels with the bytes over any channel — kvmove-serve's router, vLLM's
``kv_transfer_params``, a file — and because secrecy of the exchange would buy nothing: the
KV itself crosses the network in clear (UCX does not encrypt), so kvmove belongs on a private
network either way.

Where the key comes from, first found wins:

1. ``Agent(key=...)``: bytes, or a str (its UTF-8), at least 16 bytes;
2. ``KVMOVE_KEY``: the key itself;
3. ``KVMOVE_KEY_FILE``: a file holding it;
4. the host key: made once per user and host (``$XDG_STATE_HOME/kvmove/host.key``, default
   ``~/.local/state``), 32 random bytes, mode 0600 in a 0700 directory. It proves only "the
   same user on this host", so an agent listening anywhere but loopback needs 1-3.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvmove.errors import ConfigError, MetadataError

__all__ = ["DeploymentKey", "MIN_KEY_BYTES", "key_from_file", "resolve_key"]

MIN_KEY_BYTES = 16
_MAGIC = b"KVMS"  # signed metadata: magic | blob | HMAC-SHA256(key, context | blob)
_TAG_BYTES = 32
_CONTEXT = b"kvmove agent metadata v2\0"


@dataclass(frozen=True, slots=True)
class DeploymentKey:
    """The key a deployment's agents share, and where it came from.

    Attributes:
        source: ``"argument"``, ``"KVMOVE_KEY"``, ``"KVMOVE_KEY_FILE"`` or ``"host key"``.
    """

    secret: bytes
    source: str

    def __repr__(self) -> str:  # never the secret
        return f"DeploymentKey(source={self.source!r})"

    @property
    def host_only(self) -> bool:
        """True for the host key: it is no key to another host's agents."""
        return self.source == "host key"

    def sign(self, blob: bytes) -> bytes:
        """``blob`` with its signature: what another agent of this deployment accepts."""
        return _MAGIC + blob + self._tag(blob)

    def verify(self, signed: bytes) -> bytes:
        """The blob inside ``signed``, if this key signed it.

        Raises:
            MetadataError: not signed metadata, or signed with another key (the message says
                which, and nothing about what the blob holds).
        """
        signed = bytes(signed)
        if len(signed) < len(_MAGIC) + _TAG_BYTES or not signed.startswith(_MAGIC):
            raise MetadataError(f"not signed kvmove metadata ({len(signed)} bytes): agents "
                                "exchange metadata from Agent.metadata()")
        blob, tag = signed[len(_MAGIC):-_TAG_BYTES], signed[-_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(blob)):
            raise MetadataError("metadata not signed with this deployment's key "
                                f"(ours: {self.source}): refused before anything reads it")
        return blob

    def hash_seed(self) -> int:
        """A 64-bit seed for keyed block hashes (``block_hashes(..., seed=)``), derived from
        the key: block hashes no one without the key can predict or collide."""
        digest = hmac.new(self.secret, b"kvmove block hashes\0", hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "little")

    def prefix_seed(self) -> int:
        """The seed of a serving deployment's prefix-cache hashes: the key's ``hash_seed``,
        or 0 for the host key (it differs between hosts, which must agree on a prefix's
        hashes). Every worker and the KV-aware router use it, so their hashes agree."""
        return 0 if self.host_only else self.hash_seed()

    def _tag(self, blob: bytes) -> bytes:
        return hmac.new(self.secret, _CONTEXT + blob, hashlib.sha256).digest()


def resolve_key(key: bytes | str | None = None) -> DeploymentKey:
    """The deployment key: ``key``, ``$KVMOVE_KEY``, ``$KVMOVE_KEY_FILE``, or the host key.

    Raises:
        ConfigError: a key shorter than ``MIN_KEY_BYTES``, an unreadable key file, or no
            writable place for the host key (then set ``KVMOVE_KEY``).
    """
    if key is not None:
        return DeploymentKey(_checked(key, "key"), "argument")
    if os.environ.get("KVMOVE_KEY"):
        return DeploymentKey(_checked(os.environ["KVMOVE_KEY"], "KVMOVE_KEY"), "KVMOVE_KEY")
    if os.environ.get("KVMOVE_KEY_FILE"):
        return key_from_file(os.environ["KVMOVE_KEY_FILE"])
    return DeploymentKey(_host_key(), "host key")


def key_from_file(path: str, what: str = "KVMOVE_KEY_FILE") -> DeploymentKey:
    """The key a file holds (surrounding whitespace stripped), as ``KVMOVE_KEY_FILE`` reads it.
    ``what`` names where the path came from in errors (``--key-file`` for a command line's).

    Raises:
        ConfigError: the file cannot be read, or holds fewer than ``MIN_KEY_BYTES``.
    """
    try:
        data = Path(path).read_bytes().strip()
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path!r}: {error.strerror}") from None
    return DeploymentKey(_checked(data, f"the key in {path!r}"), "KVMOVE_KEY_FILE")


def _checked(key: bytes | str, what: str) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise ConfigError(f"{what} must be bytes or str, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{what} must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
    return bytes(key)


def _host_key() -> bytes:
    """This user's host key, made on first use (0600 in a 0700 directory, created atomically
    so that two agents starting at once agree)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                               "state")
    folder = Path(state) / "kvmove"
    path = folder / "host.key"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not path.exists():
            temp = folder / f".host.key.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(temp, path)  # fails if another agent made it first: theirs wins
            except FileExistsError:
                pass
            finally:
                temp.unlink()
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"the host key {path} is readable by others: "
                              f"chmod 600 {path}")
        return path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot use the host key at {path} ({error.strerror}): set "
                          "KVMOVE_KEY or KVMOVE_KEY_FILE") from None
