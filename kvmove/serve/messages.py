"""What the router and its workers say to each other over the control channel: every command
and event as a strict schema, and the one place a message is parsed.

A message is one ZeroMQ frame of JSON (the ROUTER socket adds the sender's identity frame in
front). Parsing checks everything a peer controls: one JSON object, a known ``op`` (commands,
router → worker) or ``ev`` (events, worker → router), every field present with its type (no
bool for an int, no string for a number), nothing extra. A message that fails is refused with
``PeerError`` naming the first fault; the caller logs it and drops it: a malformed message
never ends a receive loop.

We use pydantic (already the HTTP API's) in strict mode rather than hand-written checks:
one declaration per message is both the producer's constructor and the consumer's check,
so the two sides cannot drift apart.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvmove.agent import AgentStats
from kvmove.engine.request import SamplingParams
from kvmove.errors import PeerError
from kvmove.store.store import StoreStats

__all__ = ["HANDOFF_STAGES", "Abort", "Add", "Command", "Connect", "Connected", "Ended",
           "Event", "Failed", "Forget", "HandoffStage", "KVEvents", "MAX_KV_HASHES", "Medium",
           "Ready", "Reserve", "Reserved", "Shutdown", "Stats", "Timeline", "Tokens", "encode",
           "parse_command", "parse_event"]

Count = Annotated[int, Field(ge=0)]
# A KV hand-off's moments (``time.monotonic()``, one clock for every process of a host): the
# prefill reports the first three, the decode the others (docs/serving.md, the timeline).
HandoffStage = Literal["last_layer", "sent", "sampled", "landed", "learned", "first_step"]
Timeline = dict[HandoffStage, float]  # one side's moments of one hand-off
HANDOFF_STAGES: tuple[HandoffStage, ...] = ("last_layer", "sent", "sampled", "landed", "learned",
                                            "first_step")
Medium = Literal["cache", "store"]  # where KVEvents' blocks are: live cache, or a KVStore
MAX_KV_HASHES = 4096  # per KVEvents message (~90 kB of JSON): more go in several messages
Hashes = Annotated[list[Annotated[int, Field(ge=0, lt=2**64)]], Field(max_length=MAX_KV_HASHES)]


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# --- commands: router -> worker ---------------------------------------------------------------

class Add(_Message):
    """A request to compute (colocated, prefill); a prefill worker also gets the decode
    worker's agent its KV goes to, whose offer of the leased blocks comes by kvmove itself
    (``Agent.offer``, docs/streaming.md), never through the router."""

    op: Literal["add"] = "add"
    rid: str
    prompt: Annotated[list[Count], Field(min_length=1)]
    params: SamplingParams
    decode_peer: str | None = None


class Reserve(_Message):
    """Decode: reserve the request's blocks, lease them to the prefill worker ``peer`` and
    offer it the lease."""

    op: Literal["reserve"] = "reserve"
    rid: str
    prompt: Annotated[list[Count], Field(min_length=1)]
    params: SamplingParams
    peer: str


class Abort(_Message):
    op: Literal["abort"] = "abort"
    rid: str


class Connect(_Message):
    """Decode: become a kvmove peer of the agent listening at ``host:port``."""

    op: Literal["connect"] = "connect"
    host: str
    port: Annotated[int, Field(ge=1, le=65535)]


class Forget(_Message):
    """Decode: the worker ``peer`` died (a new run of it comes with a Connect of its own):
    stop connecting to its old address."""

    op: Literal["forget"] = "forget"
    peer: str


class Shutdown(_Message):
    op: Literal["shutdown"] = "shutdown"


Command = Annotated[Add | Reserve | Abort | Connect | Forget | Shutdown,
                    Field(discriminator="op")]


# --- events: worker -> router -----------------------------------------------------------------

class Ready(_Message):
    """The worker's engine is built and its agent listens at ``agent`` (None: colocated)."""

    ev: Literal["ready"] = "ready"
    name: str
    role: str
    agent: tuple[str, int] | None
    num_blocks: Count
    block_size: Count
    pid: int


class Stats(_Message):
    """Sent every 0.1 s (also the worker's heartbeat): its queues, free blocks, and the
    counters of its store and agent as their ``stats()`` give them."""

    ev: Literal["stats"] = "stats"
    free_blocks: Count
    waiting: Count
    running: Count
    loading: Count
    sending: Count
    store: StoreStats | None
    agent: AgentStats | None
    faults: dict[str, int] | None
    notifications_dropped: Count  # the agent's notifications, drained unread (serve uses none)
    lost_peers: list[str] = []  # peers it was connected to and is not now (being reconnected)


class Connected(_Message):
    ev: Literal["connected"] = "connected"
    peer: str | None  # None: the connect failed (``error``), the router tries again
    error: str | None = None


class Reserved(_Message):
    """The request's blocks are leased and offered to its prefill worker (``num_blocks``),
    or there is no room now (None: back-pressure, ask again)."""

    ev: Literal["reserved"] = "reserved"
    rid: str
    num_blocks: Count | None


class Tokens(_Message):
    """Every token this step sampled, as (request id, token id)."""

    ev: Literal["tokens"] = "tokens"
    items: list[tuple[str, Count]]


class Ended(_Message):
    ev: Literal["ended"] = "ended"
    rid: str
    reason: Literal["stop", "length", "abort", "handed_off"]
    error: str | None = None
    text: str = ""
    num_output: Count = 0
    num_cached: Count = 0
    num_stored: Count = 0
    kv_bytes: Count = 0
    kv_seconds: float | None = None
    kv_exposed_seconds: float | None = None
    timeline: Timeline | None = None  # this side's moments of the hand-off


class KVEvents(_Message):
    """Block hashes the worker's prefix cache (``medium`` "cache": its live blocks) or its
    KVStore ("store") now holds (``stored``) or no longer holds (``removed``), since its last
    such event; as Dynamo's KV events. Gathered after engine steps, at most
    ``MAX_KV_HASHES`` in all a message (more: several messages). The router's ``KVIndex``
    mirrors them for KV-aware routing."""

    ev: Literal["kv"] = "kv"
    medium: Medium
    stored: Hashes
    removed: Hashes


class Failed(_Message):
    """A command the worker could not take (malformed, or for no request): the worker goes
    on; a failed command *for a request* ends that request instead (``Ended``, abort)."""

    ev: Literal["error"] = "error"
    op: str | None
    error: str


Event = Annotated[Ready | Stats | Connected | Reserved | Tokens | Ended | KVEvents | Failed,
                  Field(discriminator="ev")]

_Parsed = TypeVar("_Parsed")
_COMMANDS: TypeAdapter[Command] = TypeAdapter(Command)
_EVENTS: TypeAdapter[Event] = TypeAdapter(Event)


def encode(message: _Message) -> bytes:
    return message.model_dump_json().encode()


def parse_command(payload: bytes) -> Command:
    """A command from the router.

    Raises:
        PeerError: not one JSON object of a known ``op`` with every field of its type.
    """
    return _parse(_COMMANDS, payload, "command")


def parse_event(payload: bytes) -> Event:
    """An event from a worker.

    Raises:
        PeerError: not one JSON object of a known ``ev`` with every field of its type.
    """
    return _parse(_EVENTS, payload, "event")


def _parse(adapter: TypeAdapter[_Parsed], payload: bytes, what: str) -> _Parsed:
    try:
        return adapter.validate_json(payload)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the message"
        raise PeerError(f"malformed control {what} ({len(payload)} bytes): {where}: "
                        f"{first['msg']}") from None
