"""One engine instance as a process, driven by the router over ZeroMQ.

``python -m kvmove.serve.worker_main --name W --role ROLE --router tcp://HOST:PORT ...``

The worker connects a DEALER socket (identity = its name) to the router's ROUTER socket.
Commands in (JSON): ``add``, ``reserve`` (and lease), ``abort``, ``connect``, ``shutdown``. Events out:
``ready`` (with its kvmove agent's listen address), ``reserved``, ``connected``, ``tokens``
(every token sampled this step), ``ended``, ``stats`` (queue, running, free blocks, the
KVStore's counters; also the router's heartbeat), ``error``. The KV never goes through here: prefill and decode workers
move it between their own kvmove agents.

The process exits when told to, when its parent (the server) is gone, or on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
import zmq

from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import Request, SamplingParams
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.tokenizer import load_tokenizer
from kvmove.engine.worker import ROLES, Worker
from kvmove.errors import KVMoveError
from kvmove.store import DiskTier, HostTier, KVStore

STATS_SECONDS = 0.1  # how often a worker reports its queue and free blocks
IDLE_POLL_MS = 20


def load_model(name: str, seed: int = 0) -> tuple[LlamaForCausalLM, str | None]:
    """A preset with random weights, or a local Hugging Face directory; and the directory."""
    if name in MODEL_PRESETS:
        return LlamaForCausalLM.random(MODEL_PRESETS[name], seed=seed), None
    return LlamaForCausalLM.from_pretrained(name), name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmove-serve-worker")
    p.add_argument("--name", required=True)
    p.add_argument("--role", choices=ROLES, required=True)
    p.add_argument("--router", required=True, help="the router's ZeroMQ endpoint")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=0, help="0: whole prompts")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--agent-host", default="127.0.0.1")
    p.add_argument("--transports", default=None)
    p.add_argument("--error-mode", default="peer")
    p.add_argument("--transfer-timeout", type=float, default=60.0)
    p.add_argument("--checksums", action="store_true",
                   help="per-block checksums on the KV this worker streams")
    p.add_argument("--store-dir", default=None, help="KVStore disk tier directory")
    p.add_argument("--store-disk-gb", type=float, default=16.0)
    p.add_argument("--store-host-gb", type=float, default=0.0, help="KVStore host tier size")
    p.add_argument("--cpus", default="", help="comma-separated CPU ids to run on (its own "
                   "cores, as an instance on a real cluster has its own GPU); torch uses "
                   "that many threads")
    return p


class WorkerServer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.cpus:
            cpus = {int(c) for c in args.cpus.split(",")}
            os.sched_setaffinity(0, cpus)
            torch.set_num_threads(len(cpus))
        model, path = load_model(args.model, args.seed)
        self.tokenizer = load_tokenizer(path, model.config)
        self.tokens: list[list[Any]] = []
        scheduler = SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            chunk_size=args.chunk_size or None)
        self.store = _open_store(args, model)
        self.worker = Worker(
            model, role=args.role, num_blocks=args.num_blocks, block_size=args.block_size,
            scheduler=scheduler, tokenizer=self.tokenizer, name=args.name,
            agent_kwargs={"transports": args.transports, "error_mode": args.error_mode,
                          "checksums": args.checksums},
            transfer_timeout=args.transfer_timeout,
            on_token=lambda request, token: self.tokens.append([request.id, token]),
            store=self.store)
        self.requests: dict[str, Request] = {}
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, args.name.encode())
        self.socket.setsockopt(zmq.LINGER, 500)
        self.socket.connect(args.router)
        self.parent = os.getppid()
        self.running = True
        self._last_stats = 0.0

    def send(self, event: dict) -> None:
        self.socket.send_json(event)

    def serve(self) -> None:
        agent = self.worker.agent
        address = list(agent.listen(self.args.agent_host)) if agent is not None else None
        self.send({"ev": "ready", "name": self.args.name, "role": self.args.role,
                   "agent": address, "num_blocks": self.worker.cache.num_blocks,
                   "block_size": self.args.block_size, "pid": os.getpid()})
        while self.running:
            timeout = 0 if self.worker.has_work else IDLE_POLL_MS
            if self.socket.poll(timeout):
                while self.socket.poll(0):
                    self.handle(self.socket.recv_json())
            if not self.running:
                break
            if self.worker.has_work:
                self.report(self.worker.step())
            now = time.monotonic()
            if now - self._last_stats >= STATS_SECONDS:
                self._last_stats = now
                self.send_stats()
                if os.getppid() != self.parent:  # the server is gone: so are we
                    break

    def send_stats(self) -> None:
        scheduler = self.worker.scheduler
        agent = self.worker.agent
        self.send({"ev": "stats", "free_blocks": self.worker.cache.pool.num_free,
                   "waiting": len(scheduler.waiting), "running": len(scheduler.running),
                   "loading": len(self.worker.loading), "sending": len(self.worker.sending),
                   "store": _store_stats(self.store),
                   "agent": asdict(agent.stats()) if agent is not None else None,
                   "faults": agent.faults_injected() if agent is not None else None})

    def report(self, ended: list[Request]) -> None:
        if self.tokens:
            self.send({"ev": "tokens", "items": self.tokens})
            self.tokens = []
        for request in ended:
            self.requests.pop(request.id, None)
            self.send({"ev": "ended", "rid": request.id, "reason": request.finish_reason.value,
                       "error": request.error, "text": request.text,
                       "num_output": len(request.output), "num_cached": request.num_cached,
                       "num_stored": request.num_stored,
                       "kv_bytes": request.kv_bytes, "kv_seconds": request.kv_seconds,
                       "kv_exposed_seconds": request.kv_exposed_seconds})

    def handle(self, message: dict) -> None:
        op, rid = message.get("op"), message.get("rid")
        try:
            if op == "add":
                request = self._request(message)
                self.worker.add_request(request, decode_peer=message.get("decode_peer"),
                                        remote_blocks=message.get("remote_blocks"),
                                        epoch=message.get("epoch"))
            elif op == "reserve":  # blocks, leased to the prefill worker at once
                request = self._request(message)
                blocks = self.worker.reserve(request)
                epoch = None
                if blocks is None:
                    self.requests.pop(rid)
                else:
                    epoch = self.worker.start_load(request, message["peer"])
                self.send({"ev": "reserved", "rid": rid, "blocks": blocks, "epoch": epoch})
            elif op == "abort":  # the client is gone, or another worker ended the request
                self.worker.abort(rid)
                self.requests.pop(rid, None)
            elif op == "connect":
                try:
                    peer = self.worker.agent.connect(message["host"], message["port"])
                except KVMoveError as error:  # the router tries again
                    self.send({"ev": "connected", "peer": None, "error": str(error)})
                else:
                    self.send({"ev": "connected", "peer": peer})
            elif op == "shutdown":
                self.running = False
            else:
                raise KVMoveError(f"unknown command {op!r}")
        except Exception as error:  # the router reports it to the request's client
            self.requests.pop(rid, None)
            self.send({"ev": "ended", "rid": rid, "reason": "abort", "op": op,
                       "error": f"{type(error).__name__}: {error}", "text": "",
                       "num_output": 0, "num_cached": 0, "kv_bytes": 0, "kv_seconds": None,
                       "kv_exposed_seconds": None})

    def _request(self, message: dict) -> Request:
        request = Request(message["rid"], message["prompt"],
                          SamplingParams(**message["params"]))
        self.requests[request.id] = request
        return request

    def close(self) -> None:
        self.worker.close()
        if self.store is not None:
            self.store.close()
        self.socket.close()
        self.context.term()


def _open_store(args: argparse.Namespace, model: LlamaForCausalLM) -> KVStore | None:
    """The worker's KVStore, when asked for. Its namespace is the model and seed: blocks of
    another model's weights must never match."""
    tiers: list[HostTier | DiskTier] = []
    if args.store_host_gb > 0:
        tiers.append(HostTier(int(args.store_host_gb * 1e9)))
    if args.store_dir:
        tiers.append(DiskTier(args.store_dir, int(args.store_disk_gb * 1e9)))
    if not tiers:
        return None
    return KVStore(model.config.kv_layout(args.block_size), tiers,
                   namespace=f"{args.model}:seed={args.seed}")


def _store_stats(store: KVStore | None) -> dict | None:
    if store is None:
        return None
    stats = store.stats()
    tiers = {name: {**asdict(t), "blocks": stats.blocks[name],
                    "capacity_blocks": stats.capacity_blocks[name]}
             for name, t in stats.tiers.items()}
    return {"tiers": tiers, "decisions": stats.decisions,
            "prefill_tokens_per_second": stats.prefill_tokens_per_second}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    server = WorkerServer(args)

    def stop(*_: object) -> None:
        server.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's to handle
    try:
        server.serve()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
