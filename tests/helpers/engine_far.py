"""Engine workers in their own processes, for ``test_engine.py``: a real prefill worker and a
real decode worker, each with its own model copy, KV cache and kvmove agent, driven over a
``multiprocessing`` Pipe by the test process, which plays the router.

Spawn re-imports this module by name in the child, so ``tests/`` must be on ``sys.path``
(``tests/conftest.py`` puts it there). Nothing on the data path is mocked: the KV moves through
kvmove's layer streams between the two processes.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import asdict
from typing import Any

IDLE_EXIT_SECONDS = 300.0


def _serve(conn: Any, role: str, model_seed: int, worker_kwargs: dict) -> None:
    from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
    from kvmove.engine.request import Request, SamplingParams
    from kvmove.engine.scheduler import SchedulerConfig
    from kvmove.engine.worker import Worker

    kwargs = dict(worker_kwargs)
    kwargs["scheduler"] = SchedulerConfig(**kwargs.pop("scheduler", {}))
    model = LlamaForCausalLM.random(MODEL_PRESETS[kwargs.pop("preset", "tiny")], seed=model_seed)
    worker = Worker(model, role=role, name=role, **kwargs)
    requests: dict[str, Any] = {}
    conn.send(("reply", worker.agent.listen()))

    def handle(command: str, args: tuple) -> Any:
        if command == "connect":
            return worker.agent.connect(*args)
        if command == "add":
            rid, prompt, params, peer, blocks = args
            requests[rid] = Request(rid, prompt, SamplingParams(**params))
            return worker.add_request(requests[rid], decode_peer=peer, remote_blocks=blocks)
        if command == "reserve":
            rid, prompt, params = args
            requests[rid] = Request(rid, prompt, SamplingParams(**params))
            return worker.reserve(requests[rid])
        if command == "load":
            rid, peer = args
            return worker.start_load(requests[rid], peer)
        if command == "free_blocks":
            return worker.cache.pool.num_free
        raise ValueError(f"unknown command {command!r}")

    try:
        while True:
            busy = worker.has_work
            if not conn.poll(0 if busy else IDLE_EXIT_SECONDS):
                if not busy:
                    break
            else:
                message = conn.recv()
                if message is None:
                    break
                try:
                    conn.send(("reply", handle(*message)))
                except Exception as error:  # reported to the parent, which raises it
                    conn.send(("error", f"{type(error).__name__}: {error}"))
                continue
            for request in worker.step():
                conn.send(("ended", request.id, {
                    "output": request.output, "reason": request.finish_reason.value,
                    "error": request.error, "num_cached": request.num_cached,
                    "timings": asdict(request.timings)}))
    except (EOFError, OSError):
        pass
    finally:
        worker.close()


class WorkerProcess:
    """Parent-side handle: ``call`` waits for its reply (events that arrive meanwhile are
    kept), ``wait_ended`` for requests to end; every wait has a deadline."""

    def __init__(self, role: str, model_seed: int = 0, timeout: float = 60.0,
                 **worker_kwargs: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.role, self.timeout = role, timeout
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, role, model_seed, worker_kwargs),
                                   name=f"engine-{role}", daemon=True)
        self.process.start()
        child.close()
        self.ended: dict[str, dict] = {}
        try:
            self.address = self._next_reply("start")
        except BaseException:
            self.stop()
            raise

    def call(self, command: str, *args: Any) -> Any:
        self.conn.send((command, args))
        return self._next_reply(command)

    def _next_reply(self, command: str) -> Any:
        while True:
            kind, *rest = self._receive(command)
            if kind == "reply":
                return rest[0]
            if kind == "error":
                raise RuntimeError(f"{self.role} worker failed in {command!r}: {rest[0]}")

    def _receive(self, what: str) -> tuple:
        deadline = time.monotonic() + self.timeout
        while not self.conn.poll(0.05):
            if not self.process.is_alive():
                raise RuntimeError(f"{self.role} worker died during {what} "
                                   f"(exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} worker silent for {self.timeout} s in {what}")
        message = self.conn.recv()
        if message[0] == "ended":
            self.ended[message[1]] = message[2]
        return message

    def wait_ended(self, request_ids: list[str]) -> dict[str, dict]:
        while any(rid not in self.ended for rid in request_ids):
            kind, *rest = self._receive(f"waiting for {request_ids}")
            if kind != "ended":
                raise RuntimeError(f"unexpected {kind} from the {self.role} worker: {rest}")
        return {rid: self.ended[rid] for rid in request_ids}

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
