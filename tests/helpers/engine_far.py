"""Engine workers in their own processes, for ``test_engine.py``: a real prefill worker and a
real decode worker, each with its own model copy, KV cache and kvmove agent, driven through
``kvmove.bench.harness`` by the test process, which plays the router.

Nothing on the data path is mocked: the KV moves through kvmove's layer streams between the
two processes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvmove.bench.harness import Child
from kvmove.engine.model import MODEL_PRESETS, LlamaForCausalLM
from kvmove.engine.request import Request, SamplingParams
from kvmove.engine.scheduler import SchedulerConfig
from kvmove.engine.worker import EngineWorker


class FarEngineWorker:
    """An ``EngineWorker`` in the child: commands add and hand off requests; between commands
    it steps (``work``), and each request that ends is an event ``(request id, summary)``."""

    def __init__(self, role: str, model_seed: int, worker_kwargs: dict) -> None:
        kwargs = dict(worker_kwargs)
        kwargs["scheduler"] = SchedulerConfig(**kwargs.pop("scheduler", {}))
        model = LlamaForCausalLM.random(MODEL_PRESETS[kwargs.pop("preset", "tiny")],
                                        seed=model_seed)
        self.worker = EngineWorker(model, role=role, name=role, **kwargs)
        self.requests: dict[str, Request] = {}

    def listen(self) -> tuple[str, int]:
        return self.worker.agent.listen()

    def connect(self, host: str, port: int) -> str:
        return self.worker.agent.connect(host, port)

    def add(self, rid: str, prompt: list[int], params: dict, peer: str | None) -> Any:
        self.requests[rid] = Request(rid, prompt, SamplingParams(**params))
        return self.worker.add_request(self.requests[rid], decode_peer=peer)

    def reserve(self, rid: str, prompt: list[int], params: dict) -> list[int] | None:
        self.requests[rid] = Request(rid, prompt, SamplingParams(**params))
        return self.worker.reserve(self.requests[rid])

    def load(self, rid: str, peer: str) -> Any:
        return self.worker.start_load(self.requests[rid], peer)

    def free_blocks(self) -> int:
        return self.worker.cache.pool.num_free

    def work(self) -> list[tuple[str, dict]] | None:
        if not self.worker.has_work:
            return None
        return [(request.id, {
            "output": request.output, "reason": request.finish_reason.value,
            "error": request.error, "num_cached": request.num_cached,
            "timings": asdict(request.timings)}) for request in self.worker.step()]

    def close(self) -> None:
        self.worker.close()


class WorkerProcess(Child):
    """Parent-side handle: ``call`` waits for its reply (requests that end meanwhile are
    kept), ``wait_ended`` for requests to end; every wait has a deadline."""

    def __init__(self, role: str, model_seed: int = 0, timeout: float = 60.0,
                 **worker_kwargs: Any) -> None:
        super().__init__(FarEngineWorker, role, model_seed, worker_kwargs,
                         name=f"engine-{role}", label=f"{role} worker", timeout=timeout)
        self.role = role
        self.ended: dict[str, dict] = {}
        try:
            self.address = self.call("listen")
        except BaseException:
            self.stop()
            raise

    def wait_ended(self, request_ids: list[str]) -> dict[str, dict]:
        while any(rid not in self.ended for rid in request_ids):
            rid, summary = self.event(f"waiting for {request_ids}")
            self.ended[rid] = summary
        return {rid: self.ended[rid] for rid in request_ids}
