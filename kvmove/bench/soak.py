"""Soak: ``kvmove-serve`` disaggregated under steady load for a while, with faults injected in
every worker's kvmove agent (``KVMOVE_FAULTS``), workers stalled (SIGSTOP, then SIGCONT) and
killed (SIGKILL; the server starts them again). What a long run under trouble leaves behind is
what it reports: requests served, errors by kind, wrong answers, requests that hung, blocks
leaked, and memory over time.

* **Load**: a seeded Poisson stream of completions (greedy, ``ignore_eos``) from the official
  ``openai`` client, over a fixed set of prompts of mixed lengths.
* **Wrong answers**: every answer is compared with the colocated engine's greedy output for its
  prompt, computed in this process from the same weights (the preset's, seed 0) with no
  kvmove hand-off: a hand-off that delivered wrong KV changes the text.
* **Hung**: no answer within ``request_timeout``, the client's deadline.
* **Leaked**: once the load, the stalls and the kills stop and every worker is back, the
  server is given ``settle`` seconds; a block still not free then (or quarantined) is leaked.
* **Memory**: every ``sample_every`` seconds the resident set (``/proc/PID/status`` VmRSS) of
  the server and the sum over each pool's worker processes. A killed worker restarts small, so
  a pool's curve drops at a kill; the server's is never restarted.

Exits 1 when an answer was wrong, a request hung, or a block leaked (errors are allowed: a
request in a killed worker fails, with a clear error, by design). ``tests/test_bench_soak.py``
runs a short one; docs/serving.md has a 10-minute table. ``soak_report`` holds the
configuration, the report and its text.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvmove.bench.progress import Progress, bar
from kvmove.bench.report import BenchError
from kvmove.bench.serve_server import ServerProcess
from kvmove.bench.soak_report import Sample, SoakConfig, SoakReport, format_soak
from kvmove.errors import ConfigError

__all__ = ["SoakConfig", "SoakReport", "add_parser", "format_soak", "greedy_answers",
           "greedy_tokens", "run", "run_command"]

NUM_PROMPTS = 12
MAX_CLIENTS = 16  # requests in flight at most (arrivals past it wait)


def _preset(model: str) -> tuple[Any, Any]:
    """The engine preset ``model`` and its byte tokenizer (torch is imported only here)."""
    from kvmove.engine.model import MODEL_PRESETS
    from kvmove.engine.tokenizer import ByteTokenizer

    preset = MODEL_PRESETS.get(model)
    if preset is None:
        raise ConfigError(f"soak --model must be a preset ({', '.join(MODEL_PRESETS)}), "
                          f"got {model!r}")
    return preset, ByteTokenizer(preset.bos_token_id, preset.eos_token_id)


def greedy_answers(model: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy text (``ignore_eos``) from a colocated engine here: the preset's
    weights every kvmove-serve worker builds (seed 0), no prefix caching, no hand-off."""
    tokenizer = _preset(model)[1]
    return {p: tokenizer.decode(tokens)
            for p, tokens in greedy_tokens(model, prompts, max_tokens).items()}


def greedy_tokens(model: str, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """``greedy_answers``, as token ids."""
    from kvmove.engine.model import LlamaForCausalLM
    from kvmove.engine.request import Request, SamplingParams
    from kvmove.engine.scheduler import SchedulerConfig
    from kvmove.engine.worker import EngineWorker

    preset, tokenizer = _preset(model)
    worker = EngineWorker(LlamaForCausalLM.random(preset, seed=0), num_blocks=256, block_size=16,
                          scheduler=SchedulerConfig(chunk_size=None, prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = {p: Request(f"r{i}", tokenizer.encode(p), params) for i, p in enumerate(prompts)}
    for request in requests.values():
        worker.add_request(request)
    worker.run()
    return {p: r.output for p, r in requests.items()}


def _prompts(seed: int) -> list[str]:
    rng = random.Random(seed)
    lengths = [1, 13, 40, 90, 150, 240, *(rng.randint(2, 300) for _ in range(NUM_PROMPTS - 6))]
    return [f"{i}:" + "".join(rng.choice("abcdefghij klmnop") for _ in range(n))
            for i, n in enumerate(lengths)]


def _rss_mib(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # gone meanwhile
        pass
    return 0.0


def _error_kind(error: Exception) -> str:
    """The error's status and message with what varies (names in quotes, numbers) blanked:
    "500 decode: the lease of request '…' with '…' expired: not complete by its deadline"."""
    status = getattr(error, "status_code", None)
    message = str(getattr(error, "message", "") or error)
    message = re.sub(r"^Error code: \d+ - ", "", message)
    message = re.sub(r"\d+(\.\d+)?", "N", re.sub(r"'[^']*'", "'…'", message))
    message = re.sub(r"(decode|prefill)-N", r"\1", message)
    return f"{status or type(error).__name__} {message[:110]}"


def _quietly(action: Any) -> None:
    """``action()``; a failure is skipped (a busy server or a worker mid-restart: the next
    sample, stall or kill comes anyway)."""
    try:
        action()
    except Exception:  # noqa: BLE001
        pass


class _Soak:
    """One run: the load, the trouble makers and the sampler, on threads, against one
    server."""

    def __init__(self, config: SoakConfig, server: ServerProcess, answers: dict[str, str],
                 progress: Progress) -> None:
        import httpx
        import openai

        self.config, self.server, self.answers, self.progress = config, server, answers, progress
        self.openai = openai
        # the server ends a request at request_timeout with an error; past that, no answer is
        # a hang
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="soak",
                                    timeout=config.request_timeout + 15, max_retries=0)
        self.http = httpx.Client(base_url=server.url, timeout=10.0)
        self.report = SoakReport(config)
        self.rng = random.Random(config.seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.faults: dict[tuple[str, int], dict[str, int]] = {}  # the last count per process

    def health(self) -> dict[str, Any]:
        return self.http.get("/health").json()

    def close(self) -> None:
        self.client.close()
        self.http.close()

    def ask(self, prompt: str) -> None:
        try:
            answer = self.client.completions.create(
                model=self.config.model, prompt=prompt, max_tokens=self.config.max_tokens,
                temperature=0, extra_body={"ignore_eos": True}).choices[0].text
        except self.openai.APITimeoutError:
            kind, detail = "hung", ""
        except self.openai.APIError as error:
            kind, detail = "error", _error_kind(error)
        else:
            kind = "ok" if answer == self.answers[prompt] else "wrong"
            detail = f"{prompt[:20]!r}: {answer!r} != {self.answers[prompt]!r}"
        with self.lock:
            self.report.outcomes[kind] += 1
            if kind == "error":
                self.report.errors[detail] += 1
            elif kind == "wrong" and len(self.report.wrong) < 5:
                self.report.wrong.append(detail)

    def load(self) -> None:
        prompts = list(self.answers)
        pending: list[Future] = []
        end = time.monotonic() + self.config.duration
        with ThreadPoolExecutor(MAX_CLIENTS) as pool:
            while time.monotonic() < end:
                pending.append(pool.submit(self.ask, self.rng.choice(prompts)))
                self.report.sent += 1
                time.sleep(self.rng.expovariate(self.config.rate))
            for future in pending:
                future.result()

    def _every(self, seconds: float, action: Any) -> None:
        while seconds and not self.stop.wait(seconds):
            _quietly(action)

    def _victim(self) -> dict[str, Any] | None:
        workers = [w for w in self.health()["workers"] if w["alive"] and w["ready"]]
        return self.rng.choice(workers) if workers else None

    def stall(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        os.kill(victim["pid"], signal.SIGSTOP)
        self.report.stalls.append(victim["name"])
        try:
            self.stop.wait(self.config.stall_seconds)
        finally:
            os.kill(victim["pid"], signal.SIGCONT)  # ProcessLookupError: killed meanwhile

    def kill(self) -> None:
        victim = self._victim()
        if victim is not None:
            os.kill(victim["pid"], signal.SIGKILL)
            self.report.kills.append(victim["name"])

    def sample(self, started: float) -> None:
        workers = self.health()["workers"]
        pools: dict[str, float] = {}
        for w in workers:
            pools[w["role"]] = pools.get(w["role"], 0.0) + _rss_mib(w["pid"])
            if w.get("faults") is not None:
                self.faults[w["name"], w["pid"]] = w["faults"]
        assert self.server.proc is not None
        with self.lock:
            self.report.samples.append(Sample(
                round(time.monotonic() - started, 1), round(_rss_mib(self.server.proc.pid), 1),
                {role: round(mib, 1) for role, mib in sorted(pools.items())},
                self.report.outcomes["ok"], self.report.outcomes["error"]))
        self.progress(f"{time.monotonic() - started:.0f} s")

    def settle(self) -> None:
        """Every worker back and ready, then the blocks free: what is not, after
        ``config.settle`` seconds, is leaked."""
        start = time.monotonic()
        deadline = start + self.config.settle
        while time.monotonic() < deadline:
            try:
                workers = self.health()["workers"]
            except Exception:  # noqa: BLE001 - the server busy with a restart: ask again
                time.sleep(0.5)
                continue
            held = sum(self.config.num_blocks - w.get("free_blocks", 0) for w in workers)
            quarantined = sum((w.get("agent") or {}).get("blocks_quarantined", 0)
                              for w in workers)
            ready = all(w["alive"] and w["ready"] for w in workers)
            self.report.leaked_blocks, self.report.quarantined_blocks = held, quarantined
            if ready and not held and not quarantined:
                self.report.settle_seconds = round(time.monotonic() - start, 1)
                return
            time.sleep(0.5)

    def run(self) -> SoakReport:
        started = time.monotonic()
        threads = [threading.Thread(target=self._every, args=args, daemon=True) for args in (
            (self.config.stall_every, self.stall), (self.config.kill_every, self.kill),
            (self.config.sample_every, lambda: self.sample(started)))]
        for thread in threads:
            thread.start()
        try:
            self.load()
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(self.config.stall_seconds + 15)
        _quietly(lambda: self.sample(started))
        self.settle()
        _quietly(lambda: self.sample(started))
        for counts in self.faults.values():
            for kind, n in counts.items():
                self.report.faults[kind] = self.report.faults.get(kind, 0) + n
        self.report.seconds = round(time.monotonic() - started, 1)
        return self.report


def run(config: SoakConfig, progress: Progress | None = None) -> SoakReport:
    """One soak (a fresh server).

    Raises:
        BenchError: the server did not start in time.
    """
    config.check()
    answers = greedy_answers(config.model, _prompts(config.seed), config.max_tokens)
    with ServerProcess(config.server_arguments(), config.request_timeout + 90,
                       env={"KVMOVE_FAULTS": config.faults}) as server:
        soak = _Soak(config, server, answers, progress or (lambda label: None))
        try:
            report = soak.run()
        finally:
            soak.close()
    if server.exit_code != 0:
        raise BenchError(f"kvmove-serve exited with status {server.exit_code} when stopped")
    return report


# --- the subcommand -------------------------------------------------------------------------


# SoakConfig's fields the command line sets: (field, help); each flag is the field's name
# with dashes, its type and default the field's
OPTIONS = (
    ("duration", "seconds of load"),
    ("rate", "requests per second"),
    ("max_tokens", "tokens per answer"),
    ("faults", "KVMOVE_FAULTS of every worker ('' for none)"),
    ("stall_every", "seconds between stalls (SIGSTOP) of a random worker, 0: none"),
    ("stall_seconds", "how long a stall lasts"),
    ("kill_every", "seconds between SIGKILLs of a random worker, 0: none"),
    ("sample_every", "seconds between memory samples"),
    ("num_blocks", "KV blocks per worker"),
    ("request_timeout", "a request's deadline on the server (the client waits 15 s more)"),
    ("settle", "seconds after the load for every block to be free"),
    ("model", "engine preset"),
    ("seed", "the load's and the prompts' seed"),
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    sub = commands.add_parser(
        "soak", help="kvmove-serve disaggregated under load with faults, stalls and kills",
        description="Runs kvmove-serve (1 prefill + 1 decode worker) under a steady Poisson "
        "load with KVMOVE_FAULTS in every worker's agent, a worker stalled (SIGSTOP) and one "
        "killed now and then; reports requests served, errors by kind, wrong answers (against "
        "the colocated engine), hung requests, blocks leaked and memory over time. Exits 1 on "
        "a wrong answer, a hung request or a leaked block.")
    defaults = SoakConfig()
    for name, text in OPTIONS:
        default = getattr(defaults, name)
        sub.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                         help=f"{text} (default {default!r})")
    sub.add_argument("--json", action="store_true", help="print the report as JSON only")
    sub.set_defaults(run=run_command)


def run_command(args: argparse.Namespace) -> int:
    config = SoakConfig(**{name: getattr(args, name) for name, _ in OPTIONS})
    config.check()
    try:
        import httpx  # noqa: F401
        import openai  # noqa: F401
    except ImportError:
        raise ConfigError("kvmove-bench soak needs the openai client: pip install openai "
                          "kvmove[serve]") from None
    steps = int(config.duration / config.sample_every) + 3
    with bar(args, steps) as progress:
        report = run(config, progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_soak(report))
    return 0 if report.passed else 1
