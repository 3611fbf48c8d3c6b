"""``kvmove-bench scale``'s rows, their text and their plot (the measuring is ``scale``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvmove.bench.report import aligned, pyplot, save_figure

__all__ = ["LeaseRow", "PeerRow", "ScaleReport", "format_scale", "plot_scale"]


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """``leases`` one-block requests streamed into as many concurrent leases, in ``seconds``
    (the median batch)."""

    leases: int
    seconds: float

    @property
    def per_lease_us(self) -> float:
        return self.seconds / self.leases * 1e6

    @property
    def leases_per_s(self) -> float:
        return self.leases / self.seconds


@dataclass(frozen=True, slots=True)
class PeerRow:
    """One receiver with ``peers`` senders connected."""

    peers: int
    connect_median_s: float     # of the connects so far
    connect_max_s: float
    agent_rss: int              # private bytes of the process per sender agent
    connection_rss: int         # private bytes per connect (both ends)
    connection_shared: int      # shared-memory bytes per connect (UCX shm, mapped peer)
    nbytes: int                 # all peers' streams at this count together
    seconds: float              # first lease to last load complete

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass(frozen=True, slots=True)
class ScaleReport:
    lease_nbytes: int           # one lease: one block, every layer
    transports: str | None
    same_host: str
    leases: list[LeaseRow]
    peers: list[PeerRow]

    def to_dict(self) -> dict[str, Any]:
        return {"lease_nbytes": self.lease_nbytes, "transports": self.transports,
                "same_host": self.same_host,
                "leases": [{**asdict(r), "per_lease_us": r.per_lease_us,
                            "leases_per_s": r.leases_per_s,
                            "gbps": r.leases * self.lease_nbytes / r.seconds / 1e9}
                           for r in self.leases],
                "peers": [{**asdict(r), "gbps": r.gbps} for r in self.peers]}


def format_scale(report: ScaleReport) -> str:
    transports = report.transports or "UCX's choice"
    path = f"transports {transports}, same host: {report.same_host}"
    lines = [f"kvmove-bench scale: one agent's cost as leases and peers grow ({path}; "
             f"a lease is one block of every layer, {report.lease_nbytes // 1024} KiB)", "",
             "Concurrent leases (one sender, one receiver; median batch):"]
    first = report.leases[0].per_lease_us if report.leases else 0.0
    lines += aligned(
        ["leases", "batch ms", "per lease us", "vs fewest", "leases/s", "GB/s"],
        [[str(r.leases), f"{r.seconds * 1e3:.2f}", f"{r.per_lease_us:.0f}",
          f"{r.per_lease_us / first:.2f}x", f"{r.leases_per_s:,.0f}",
          f"{r.leases * report.lease_nbytes / r.seconds / 1e9:.2f}"] for r in report.leases],
        set())
    lines += ["", "Peers on one receiver (each streams its own lease at once):"]
    lines += aligned(
        ["peers", "connect ms (median)", "connect ms (max)", "agent MiB", "connection MiB",
         "shared MiB", "GB/s all"],
        [[str(r.peers), f"{r.connect_median_s * 1e3:.1f}", f"{r.connect_max_s * 1e3:.1f}",
          f"{r.agent_rss / 2**20:.1f}", f"{r.connection_rss / 2**20:.2f}",
          f"{r.connection_shared / 2**20:.2f}", f"{r.gbps:.2f}"]
         for r in report.peers], set())
    lines += ["", "Memory per peer, the mean up to that count, this process's resident set "
              "before any byte moved: 'agent' the private memory creating a sender agent took "
              "(UCX context and worker, threads), 'connection' the private memory its connect "
              "added at both ends, 'shared' the shared memory it added (UCX's shared-memory "
              "segments, and the mapping of the receiver's memory, counted once per mapping "
              "though its pages are the receiver's)."]
    return "\n".join(lines)


def plot_scale(report: ScaleReport, path: str) -> None:
    """Time per lease against concurrent leases; connect time and GB/s against peers."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r.leases for r in report.leases], [r.per_lease_us for r in report.leases],
              marker="o")
    left.set(xscale="log", xlabel="concurrent leases", ylabel="time per lease (us)",
             title="Concurrent one-block leases")
    left.set_ylim(bottom=0)
    counts = [r.peers for r in report.peers]
    right.plot(counts, [r.connect_median_s * 1e3 for r in report.peers], marker="o",
               label="connect (ms, median)")
    right.set(xscale="log", xlabel="peers on one agent", ylabel="connect (ms)",
              title="Peers on one agent")
    right.set_ylim(bottom=0)
    twin = right.twinx()
    twin.plot(counts, [r.gbps for r in report.peers], marker="s", color="tab:orange",
              label="all peers streaming (GB/s)")
    twin.set_ylabel("GB/s, all peers")
    twin.set_ylim(bottom=0)
    right.legend(loc="upper left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)
