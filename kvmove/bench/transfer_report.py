"""``kvmove-bench transfer``'s configuration and results: what to measure, and the rows and
baselines a run produced as plain data (``to_dict`` is ``--json``); ``transfer_text`` holds
the text and plot of them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmove.agent import ERROR_MODES, SAME_HOST_PATHS
from kvmove.bench import perftest
from kvmove.bench.address import parse_address
from kvmove.bench.against_report import AGAINST, NixlRun
from kvmove.bench.engine_caches import WRAP_FORMATS, layout_for_format
from kvmove.bench.mooncake_report import MooncakeRun
from kvmove.bench.plan import DEFAULT_LINKS, transfer_ms
from kvmove.bench.report import RoundTrip
from kvmove.errors import ConfigError
from kvmove.kv_spec import KVSpec
from kvmove.runtime import UcxInfo

__all__ = ["MEMORIES", "BenchConfig", "BenchReport", "NATIVE", "PERFTEST_TEST", "PLACEMENTS",
           "ROUND_TRIP_WARMUP", "Registration", "RoundTrip", "SWEEP_BLOCK_SIZES", "TransferRow"]

MEMORIES = ("host", "cuda")
PLACEMENTS = ("allocator", "scatter")
SWEEP_BLOCK_SIZES = (16, 32, 64, 128)
# The ucx_perftest test each operation is compared against.
PERFTEST_TEST = {"write": "ucp_put_bw", "read": "ucp_get"}
# The cache label of rows moved between KVCaches kvmove allocated; wrapped rows carry the format.
NATIVE = "native"
# Untimed round trips before the timed ones (kvmove's and a peer library's alike).
ROUND_TRIP_WARMUP = 20
# What a Registration times, for the text and the JSON.
REGISTRATION_TIMED = (
    "KVCache.wrap (0 for a native cache) + Agent(...) (a UCX context and worker, then one "
    "ucp_mem_map per segment: per engine tensor, or the native cache's one region), in this "
    "process, one sample per cache and block size; the memory was allocated and every page "
    "written first, untimed")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What ``run`` measures.

    Args:
        model: a ``KVSpec`` preset.
        num_tokens: prompt length; ``blocks_for(num_tokens)`` whole blocks move.
        block_sizes: tokens per block, one set of rows each (``SWEEP_BLOCK_SIZES`` sweeps).
        placements: subset of ``PLACEMENTS``.
        transports: UCX transport list for both agents and ``ucx_perftest`` (None: UCX's).
        error_mode: the agents' ``error_mode``; ``"peer"`` also runs ``ucx_perftest -e``.
        same_host: the agents' ``same_host``: ``"map"`` copies into the peer's mapped memory
            (both processes run here), ``"ucx"`` measures UCX's transports instead.
        iters: timed iterations per row (plus one warm-up); the best is reported.
        spare_factor: each cache holds this many times the blocks moved.
        round_trips: timed one-block write + notification ping-pongs.
        perftest_sizes: extra ``ucp_put_bw`` message sizes (the rows' op sizes always run).
        timeout: deadline in seconds of every wait (transfer, peer reply, ucx_perftest).
        seed: for the data pattern and the scattered placement.
        wrap: also move the same KV between two caches of this engine's tensors
            (``engine_caches.WRAP_FORMATS``) wrapped with ``KVCache.wrap``, after the native
            rows; "mla" moves it as one latent of the same bytes per token, native rows too.
        against: also run the native rows' workload and the round trip through these
            libraries (some of ``against_report.AGAINST``: "nixl", "mooncake"), each in the
            same run after kvmove's rows, compared row by row.
        connect: ``"HOST:PORT"`` of a ``kvmove-bench transfer --listen`` on another machine,
            which then hosts the far side (``kvmove.bench.remote``); None: a process here.
        host: the address this side's agents serve on (None: loopback, or with ``connect``
            this machine's address on the route to HOST).
        memory: ``"host"``, or ``"cuda"``: both caches in device memory (cuda:0 on each side),
            the pattern checked through a host copy of the blocks.
    """

    model: str = "llama-3.1-8b"
    num_tokens: int = 4000
    block_sizes: tuple[int, ...] = (16,)
    placements: tuple[str, ...] = ("allocator",)
    transports: str | None = None
    error_mode: str = "peer"
    same_host: str = "map"
    iters: int = 3
    spare_factor: int = 2
    round_trips: int = 200
    perftest_sizes: tuple[int, ...] = ()
    timeout: float = 60.0
    seed: int = 0
    wrap: str | None = None
    against: tuple[str, ...] = ()
    connect: str | None = None
    host: str | None = None
    memory: str = "host"

    def __post_init__(self) -> None:
        for name in ("num_tokens", "iters", "spare_factor", "round_trips"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not self.block_sizes:
            raise ConfigError("block_sizes must hold at least one block size, got none")
        for block_size in self.block_sizes:
            self.layout(block_size)  # validates model and block_size
        if not self.placements or set(self.placements) - set(PLACEMENTS):
            raise ConfigError(f"placements must be some of {PLACEMENTS}, got {self.placements}")
        if self.error_mode not in ERROR_MODES:
            raise ConfigError(f"error_mode must be one of {ERROR_MODES}, got {self.error_mode!r}")
        if self.same_host not in SAME_HOST_PATHS:
            raise ConfigError(f"same_host must be one of {SAME_HOST_PATHS}, got "
                              f"{self.same_host!r}")
        if self.transports is not None and not self.transports.strip():
            raise ConfigError(f"transports must be a UCX transport list or None, got "
                              f"{self.transports!r}")
        if any(size <= 0 for size in self.perftest_sizes):
            raise ConfigError(f"perftest_sizes must be positive, got {self.perftest_sizes}")
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < math.inf):
            raise ConfigError(f"timeout must be positive and finite, got {self.timeout!r}")
        if self.wrap is not None and self.wrap not in WRAP_FORMATS:
            raise ConfigError(f"wrap must be one of {WRAP_FORMATS} or None, got {self.wrap!r}")
        if (not isinstance(self.against, tuple) or set(self.against) - set(AGAINST)
                or len(set(self.against)) != len(self.against)):
            raise ConfigError(f"against must be a tuple of distinct names of {AGAINST}, got "
                              f"{self.against!r}")
        if self.memory not in MEMORIES:
            raise ConfigError(f"memory must be one of {MEMORIES}, got {self.memory!r}")
        if self.memory == "cuda" and (self.wrap is not None or self.against):
            raise ConfigError("memory 'cuda' moves native caches only: not with wrap or "
                              "against")
        if self.connect is not None:
            parse_address(self.connect, "connect")
            if self.against:
                raise ConfigError(f"against={self.against!r} runs both sides on this host; "
                                  "it cannot run with connect")

    def layout(self, block_size: int) -> KVSpec:
        layout = KVSpec.preset(self.model, block_size=block_size)
        return layout_for_format(self.wrap, layout) if self.wrap else layout

    @property
    def caches(self) -> tuple[str, ...]:
        """The caches moved, in order: ``NATIVE``, then the wrapped format if any."""
        return (NATIVE,) + ((self.wrap,) if self.wrap else ())

    @property
    def device(self) -> str | None:
        """Where both caches live: None (host memory) or the CUDA device."""
        return "cuda:0" if self.memory == "cuda" else None

    @property
    def agent_kwargs(self) -> dict[str, Any]:
        where = {"host": self.host} if self.host is not None else {}
        return {"transports": self.transports, "error_mode": self.error_mode,
                "same_host": self.same_host, **where}


@dataclass(frozen=True, slots=True)
class TransferRow:
    """One configuration's best timed iteration. Seconds are wall time from the ``write`` or
    ``read`` call until ``wait`` returned; ``post_seconds`` is the part spent posting."""

    op: str
    placement: str
    block_size: int
    nbytes: int
    num_blocks: int
    num_ops: int
    post_seconds: float
    total_seconds: float
    complete_seconds: float
    iter_seconds: tuple[float, ...]
    warmup_seconds: float
    mismatched_blocks: int
    cache: str = NATIVE  # or the wrapped format both sides used

    @property
    def verified(self) -> bool:
        return self.mismatched_blocks == 0

    @property
    def op_nbytes(self) -> int:
        """Mean bytes per posted operation (one coalesced run of one or more layers)."""
        return self.nbytes // self.num_ops

    @property
    def gbytes_per_s(self) -> float:
        return self.nbytes / self.total_seconds / 1e9

    @property
    def post_share_pct(self) -> float:
        return self.post_seconds / self.total_seconds * 100.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verified": self.verified, "op_nbytes": self.op_nbytes,
                "gbytes_per_s": self.gbytes_per_s, "post_share_pct": self.post_share_pct}


@dataclass(frozen=True, slots=True)
class Registration:
    """Making one side's cache and agent ready to move ``nbytes`` (``REGISTRATION_TIMED``)."""

    cache: str
    block_size: int
    nbytes: int
    wrap_seconds: float
    agent_seconds: float

    @property
    def seconds(self) -> float:
        return self.wrap_seconds + self.agent_seconds

    @property
    def seconds_per_gb(self) -> float:
        return self.seconds / (self.nbytes / 1e9)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": self.seconds, "seconds_per_gb": self.seconds_per_gb}


@dataclass(frozen=True, slots=True)
class BenchReport:
    """Everything one ``run`` measured; ``to_dict`` is ``kvmove-bench transfer --json``."""

    config: BenchConfig
    rows: tuple[TransferRow, ...]
    round_trip: RoundTrip
    memcpy: dict[int, float]  # nbytes -> GB/s
    perftest_bw: tuple[perftest.PerftestResult, ...]
    perftest_lat: tuple[perftest.PerftestResult, ...]
    wall_seconds: float
    registrations: tuple[Registration, ...] = ()
    nixl: NixlRun | None = None  # with "nixl" in against
    # (transport, device) pairs UCX chose between the two agents (Agent.peer_transports).
    transports_used: tuple[tuple[str, str], ...] = ()
    # How the bytes went (Agent.peer_path): "mapped" (one copy into the peer's mapped memory;
    # UCX carries only the notifications) or "ucx"; "" where not measured.
    path: str = ""
    # The UCX the run used and what it offers here (why a run used tcp, not RDMA).
    ucx: UcxInfo | None = None
    # nbytes -> GB/s of kvmove's own copy kernel and threads between two buffers of one
    # process (_C.copy_limit_gbytes_per_s): the most a same-host transfer can reach here.
    copy_limit: dict[int, float] = field(default_factory=dict)
    copy_threads: int = 0
    mooncake: MooncakeRun | None = None  # with "mooncake" in against

    @property
    def verified(self) -> bool:
        """Every byte of every row arrived right: kvmove's and, with ``against``, the other
        library's."""
        return (all(row.verified for row in self.rows)
                and all(run.verified for run in (self.nixl, self.mooncake) if run is not None))

    def native_for(self, row: TransferRow) -> TransferRow:
        """The native row of the same op, placement and block size, measured in this run."""
        return next(r for r in self.rows if r.cache == NATIVE and
                    (r.op, r.placement, r.block_size) == (row.op, row.placement, row.block_size))

    def native_ratio(self, row: TransferRow) -> float | None:
        """A wrapped row's GB/s over its native row's (None for a native row)."""
        if row.cache == NATIVE:
            return None
        return row.gbytes_per_s / self.native_for(row).gbytes_per_s

    def memcpy_pct(self, row: TransferRow) -> float:
        return row.gbytes_per_s / self.memcpy[row.nbytes] * 100.0

    def limit_pct(self, row: TransferRow) -> float | None:
        """The row's GB/s as a share of this machine's copy limit (None: not measured, as
        between two machines)."""
        limit = self.copy_limit.get(row.nbytes)
        return None if limit is None else row.gbytes_per_s / limit * 100.0

    def perftest_for(self, row: TransferRow) -> perftest.PerftestResult:
        """The ``ucp_put_bw`` (write) or ``ucp_get`` (read) baseline at the row's op size."""
        test = PERFTEST_TEST[row.op]
        return next(p for p in self.perftest_bw
                    if p.test == test and p.message_nbytes == row.op_nbytes)

    def perftest_pct(self, row: TransferRow) -> float | None:
        baseline = self.perftest_for(row)
        gbps = baseline.gbytes_per_s  # set exactly when the baseline is available
        return row.gbytes_per_s / gbps * 100.0 if gbps is not None else None

    def links(self) -> list[dict[str, Any]]:
        """The first allocator rows' bytes over the article's links and as measured here."""
        rows = [r for r in self.rows if r.placement == self.config.placements[0]
                and r.block_size == self.config.block_sizes[0] and r.cache == NATIVE]
        links = [{"name": link.name, "gbytes_per_s": link.gbytes_per_s,
                  "transfer_ms": transfer_ms(rows[0].nbytes, link), "measured": False}
                 for link in DEFAULT_LINKS]
        return links + [{"name": f"this machine, {r.op} ({r.placement})",
                         "gbytes_per_s": r.gbytes_per_s, "transfer_ms": r.total_seconds * 1e3,
                         "measured": True} for r in rows]

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        layout = self.config.layout(self.config.block_sizes[0])
        rows = [{**row.to_dict(), "memcpy_pct": self.memcpy_pct(row),
                 "copy_limit_pct": self.limit_pct(row),
                 "perftest_pct": self.perftest_pct(row),
                 "perftest_test": PERFTEST_TEST[row.op], **self._vs_native(row),
                 **self._vs_nixl(row), **self._vs_mooncake(row)}
                for row in self.rows]
        return {
            "config": config, "statistic": f"best of {self.config.iters} after 1 warm-up",
            "layout": asdict(layout), "kv_bytes": layout.bytes_for(self.config.num_tokens),
            "rows": rows, "verified": self.verified, "round_trip": self.round_trip.to_dict(),
            "baselines": {
                "memcpy": [{"nbytes": n, "gbytes_per_s": g} for n, g in self.memcpy.items()],
                "copy_limit": [{"nbytes": n, "gbytes_per_s": g, "threads": self.copy_threads}
                               for n, g in self.copy_limit.items()],
                "perftest_bw": [p.to_dict() for p in self.perftest_bw],
                "perftest_put_lat": [p.to_dict() for p in self.perftest_lat],
            },
            "registration": [r.to_dict() for r in self.registrations],
            "transports_used": [f"{tl}/{dev}" for tl, dev in self.transports_used],
            "path": self.path,
            "ucx": None if self.ucx is None else self.ucx.to_dict(),
            "registration_timed": REGISTRATION_TIMED,
            "links": self.links(), "wall_seconds": self.wall_seconds,
            "against": self._against(),
        }

    def _vs_nixl(self, row: TransferRow) -> dict[str, Any]:
        """NIXL's GB/s for ``row``'s workload and kvmove / NIXL (None without one)."""
        run = self.nixl
        nixl = None if run is None else run.row_for(row)
        if run is None or nixl is None:
            return {"nixl_gbytes_per_s": None, "nixl_ratio": None}
        return {"nixl_gbytes_per_s": nixl.gbytes_per_s, "nixl_ratio": run.ratio(row)}

    def _against(self) -> list[dict[str, Any]]:
        """The other libraries' runs (``against``), in the order they ran."""
        return [run.to_dict(self.round_trip) for run in (self.nixl, self.mooncake)
                if run is not None]

    def _vs_mooncake(self, row: TransferRow) -> dict[str, Any]:
        """Mooncake's GB/s for ``row``'s workload and kvmove / Mooncake (None without one)."""
        run = self.mooncake
        mooncake = None if run is None else run.row_for(row)
        if run is None or mooncake is None:
            return {"mooncake_gbytes_per_s": None, "mooncake_ratio": None}
        return {"mooncake_gbytes_per_s": mooncake.gbytes_per_s, "mooncake_ratio": run.ratio(row)}

    def _vs_native(self, row: TransferRow) -> dict[str, Any]:
        if row.cache == NATIVE:
            return {"native_ratio": None, "native_num_ops": None}
        return {"native_ratio": self.native_ratio(row),
                "native_num_ops": self.native_for(row).num_ops}


# --- text and plot --------------------------------------------------------------------------

# A WRITE row and the ucp_put_bw curve it is compared with share a color; READ and ucp_get too.
