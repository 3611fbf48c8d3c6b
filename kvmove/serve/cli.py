"""``kvmove-serve``: a router and its engine worker processes, behind an OpenAI-compatible API.

    kvmove-serve --mode disagg --prefill 1 --decode 1 --model tiny --port 8000

starts one process per engine instance (``--ray [ADDRESS]``: each as a Ray actor's child,
placed by Ray on a cluster), waits until every one is ready, prints
``kvmove-serve ready on http://HOST:PORT ...`` and serves until SIGINT or SIGTERM, then stops
every worker process before exiting (none is left behind: workers also exit by themselves
when the server process is gone).

    kvmove-serve --vllm-prefill http://p0:8100 --vllm-decode http://d0:8200 http://d1:8200

fronts vLLM instances instead (``vllm_proxy.py``): no workers, no model here, so the engine's
flags are refused with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import kvmove
from kvmove import _log
from kvmove.errors import ConfigError, KVMoveError, UCXError
from kvmove.integrations.vllm.params import TransferMode
from kvmove.serve.config import MODES, ROUTINGS, ConnectionLimits, Mode, ServeConfig
from kvmove.serve.planner import Bounds, parse_bounds
from kvmove.serve.vllm.proxy_config import KV_MODES, ProxyConfig

# Flags that configure kvmove's own engine workers: meaningless in front of vLLM.
_ENGINE_ONLY = ("mode", "workers", "prefill", "decode", "chunk_size", "model", "num_blocks",
                "block_size", "max_num_seqs", "agent_host", "net_devices", "key_file",
                "transports",
                "no_pin_cpus", "transfer_timeout", "store_dir", "store_host_gb",
                "store_disk_gb", "no_checksums", "no_restart", "ray", "ray_resources")
_UNSET = object()

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DEFAULTS = ServeConfig()
_LIMITS = ConnectionLimits()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvmove-serve",
        description="Serve a model with kvmove: colocated, chunked-prefill or disaggregated "
        "prefill/decode workers behind an OpenAI-compatible API.")
    p.add_argument("--mode", choices=MODES, default=Mode.DISAGG.value,
                   help="colocated: whole-prompt prefill and decode in one batch; chunked: "
                   "the same with chunked prefill; disagg: prefill and decode workers, KV "
                   "streamed layer by layer over kvmove (default disagg)")
    p.add_argument("--workers", type=int, default=2,
                   help="engine instances for colocated/chunked (default 2)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disagg; default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disagg; default 1)")
    p.add_argument("--routing", choices=ROUTINGS, default=_DEFAULTS.routing,
                   help="where a request goes among the prefill (colocated) workers: kv: the "
                   "one whose cached prefix saves the most prefill, traded off against its "
                   "queue (docs/serving.md, How routing decides); least-loaded: the fewest "
                   "requests in flight (default kv). In front of vLLM: among the "
                   "--vllm-prefill instances, from their KV events (--kv-events-config)")
    p.add_argument("--planner", action="store_true",
                   help="disagg: add and drain prefill and decode workers as their queues and "
                   "utilisation say, within --prefill-workers / --decode-workers (docs/"
                   "serving.md, How the planner decides)")
    p.add_argument("--prefill-workers", type=_bounds, default=None, metavar="MIN:MAX",
                   help="the planner's bounds on the prefill pool (default 1:2x --prefill)")
    p.add_argument("--decode-workers", type=_bounds, default=None, metavar="MIN:MAX",
                   help="the planner's bounds on the decode pool (default 1:2x --decode)")
    p.add_argument("--planner-interval", type=float, default=_DEFAULTS.planner_interval,
                   help="seconds between the planner's samples (default 1)")
    p.add_argument("--chunk-size", type=int, default=512,
                   help="prefill chunk in tokens (chunked, and disagg's prefill; default 512)")
    p.add_argument("--model", default="tiny",
                   help="engine preset (tiny, small) or a local Hugging Face Llama directory")
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=64, help="batch size limit per worker")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port, 0 for any (default 8000)")
    p.add_argument("--agent-host", default="127.0.0.1",
                   help="address the workers' kvmove agents serve on (default 127.0.0.1)")
    p.add_argument("--net-devices", default=None,
                   help="UCX devices the workers' agents use (UCX_NET_DEVICES syntax, e.g. "
                   "mlx5_0:1; 'all'). Default: $UCX_NET_DEVICES, else --agent-host's interface")
    p.add_argument("--key-file", default=None,
                   help="the deployment key the workers' agents share (docs/security.md; it "
                   "also keys the prefix cache's block hashes). Default: KVMOVE_KEY_FILE or "
                   "KVMOVE_KEY, else this user's host key (loopback only)")
    p.add_argument("--transports", default=None, help="UCX transports for the KV (default: "
                   "UCX's choice)")
    p.add_argument("--no-pin-cpus", action="store_true",
                   help="let workers share every core (default: each worker on its own cores "
                   "when there are at least as many cores as workers)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds a request may go without a token (default 120)")
    p.add_argument("--transfer-timeout", type=float, default=60.0,
                   help="seconds a KV hand-off may take before the decode side gives it up "
                   "(its lease's deadline; default 60)")
    p.add_argument("--store-dir", default=None,
                   help="keep KV blocks on disk here (a KVStore disk tier per prefill or "
                   "colocated worker, in DIR/<worker>): a repeated prefix is loaded, not "
                   "prefilled again, even after a restart")
    p.add_argument("--store-host-gb", type=float, default=0.0,
                   help="a KVStore host-memory tier of this many GB per prefill or colocated "
                   "worker (default 0: none)")
    p.add_argument("--store-disk-gb", type=float, default=None,
                   help="the disk tier's size per worker with --store-dir (default 16)")
    p.add_argument("--no-checksums", action="store_true",
                   help="no per-block checksums on the KV hand-off (default: on; the decode "
                   "side verifies every block before it is used)")
    p.add_argument("--no-restart", action="store_true",
                   help="a worker process that dies is not started again (default: it is, "
                   "and re-admitted once ready)")
    p.add_argument("--max-pending", type=int, default=_DEFAULTS.max_pending,
                   help="completions admitted at once, streams included; more are refused "
                   f"with 429 and Retry-After (default {_DEFAULTS.max_pending})")
    p.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                   help="the largest request body; larger ones are refused with 413 (default "
                   f"{_DEFAULTS.max_body_bytes})")
    p.add_argument("--body-timeout", type=float, default=_LIMITS.body_timeout,
                   help="seconds a completion's body may take to arrive after its headers; "
                   "later is a 408. A request counts against --max-pending only once its "
                   f"body is in (default {_LIMITS.body_timeout:g})")
    p.add_argument("--header-timeout", type=float, default=_LIMITS.header_timeout,
                   help="seconds a request's headers may take to arrive, from the connection "
                   "or the previous response; then the connection is closed (default "
                   f"{_LIMITS.header_timeout:g})")
    p.add_argument("--max-connections", type=int, default=None,
                   help="HTTP connections held at once; past it, the one that has waited "
                   "longest for its request is closed (default: the file-descriptor limit, "
                   "its soft value raised to the hard one at start, less an eighth of it, at "
                   "least 64: 896 of 1,024)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names served, '*' for any (default: "
                   "localhost, 127.0.0.1, ::1 and --host); others are refused with 421, "
                   "which stops DNS rebinding onto a loopback server")
    p.add_argument("--log-level", choices=sorted(_log.LEVELS), default=None,
                   help="the router's, uvicorn's and every worker's log level (default: "
                   "KVMOVE_LOG_LEVEL, else info); workers' output is logged with their names")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run each worker as a Ray actor's child, placed by Ray's resources: "
                   "on the Ray cluster at ADDRESS (HOST:PORT), or, without ADDRESS, on a Ray "
                   "started here. Needs pip install 'kvmove[ray]' (docs/serving.md)")
    p.add_argument("--ray-resources", action="append", default=None, metavar="ROLE=JSON",
                   help="a role's (prefill, decode, colocated) Ray resources per worker, e.g. "
                   "prefill='{\"CPU\": 1, \"GPU\": 1}' (repeatable; default: one CPU and one "
                   "of the role's own resource, {\"prefill\": 1}, or one GPU where no node has "
                   "that resource and the cluster has GPUs)")
    # extend: "--vllm-prefill A --vllm-prefill B" is both (store would keep B alone)
    p.add_argument("--vllm-prefill", nargs="+", action="extend", metavar="URL", default=None,
                   help="front these vLLM prefill instances (with --vllm-decode) instead of "
                   "running engine workers; vLLM's P/D protocol (docs/serving.md)")
    p.add_argument("--vllm-decode", nargs="+", action="extend", metavar="URL", default=None,
                   help="the vLLM decode instances (with --vllm-prefill)")
    p.add_argument("--kv-mode", choices=KV_MODES, default=None,
                   help="with --vllm-*: push (kvmove's layer-wise hand-off, the decode "
                   "reserves blocks first) or pull (vLLM's: the decode reads the prefill's "
                   "KV once it is done); default push")
    p.add_argument("--version", action="version", version=f"kvmove-serve {kvmove.__version__}")
    return p


def log_level(flag: str | None) -> str:
    """``--log-level``, else ``KVMOVE_LOG_LEVEL``, else info."""
    return (flag or os.environ.get("KVMOVE_LOG_LEVEL") or "info").lower()


def _setup_logging(level: str) -> None:
    logging.basicConfig(format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger().setLevel(_log.LEVELS[level])
    _log.set_level(level)


def _model_facts(model: str) -> tuple[object, int]:
    """The tokenizer and context length the router needs (workers load the weights)."""
    from kvmove.engine.model import MODEL_PRESETS, ModelConfig
    from kvmove.engine.tokenizer import load_tokenizer

    if model in MODEL_PRESETS:
        config, path = MODEL_PRESETS[model], None
    else:
        config_file = os.path.join(model, "config.json")
        if not os.path.isdir(model):
            raise ConfigError(f"--model {model!r}: no such directory, and not a preset (one "
                              f"of {', '.join(MODEL_PRESETS)})")
        if not os.path.isfile(config_file):
            raise ConfigError(f"--model {model!r}: the directory has no config.json (a "
                              "Hugging Face checkpoint's)")
        with open(config_file) as f:
            config, path = ModelConfig.from_hf(json.load(f)), model
    return load_tokenizer(path, config), config.max_position_embeddings


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its shutdown (so the process dies of the
        signal); kvmove-serve handles them itself and exits 0 once everything stopped."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


def _listen(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound before any worker starts: a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise KVMoveError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.listen(2048)
    return sock


async def _serve(config: ServeConfig) -> int:
    from kvmove.serve.app import create_app  # with the router: torch, not needed before
    from kvmove.serve.router import Router

    tokenizer, max_positions = _model_facts(config.model)
    name = os.path.basename(config.model.rstrip("/"))
    listener = _listen(config.host, config.port)
    router = Router(config)
    app = create_app(router, tokenizer, name, max_positions,
                     tokenizer_dir=getattr(tokenizer, "path", None))
    roles = ", ".join(f"{n} ({r})" for n, r in config.roles())
    # streams in flight get an error event instead of a long wait
    return await _run(app, listener, config.log_level, config.connections,
                      lambda: router.abort_all("the server is shutting down"),
                      f"mode {config.mode}, model {name}, workers: {roles}")


async def _serve_proxy(config: ProxyConfig) -> int:
    from kvmove.serve.vllm.proxy import Proxy, create_app

    if config.log_level != "debug":  # httpx logs every upstream request at info
        logging.getLogger("httpx").setLevel(logging.WARNING)
    listener = _listen(config.host, config.port)
    about = (f"vLLM proxy, kv-mode {config.kv_mode}, prefill: {' '.join(config.prefill)}, "
             f"decode: {' '.join(config.decode)}")
    return await _run(create_app(Proxy(config)), listener, config.log_level,
                      config.connections, lambda: None, about)


async def _run(app: Callable[..., Any], listener: socket.socket, level: str,
               limits: ConnectionLimits, abort: Callable[[], None], about: str) -> int:
    """Serves ``app`` on ``listener`` until SIGINT or SIGTERM (``abort()`` first), printing
    the ready line (``about`` in its parentheses) once it listens."""
    import uvicorn

    from kvmove.serve.connections import guarded_h11

    # log_config None: uvicorn's loggers keep their level (ours) and use our handler and format
    server = _server_class()(uvicorn.Config(
        app, log_config=None, log_level=level, lifespan="on", timeout_graceful_shutdown=5,
        http=guarded_h11(limits)))

    def shut_down() -> None:
        abort()
        server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a clean shutdown, then exit status 0
        loop.add_signal_handler(sig, shut_down)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = listener.getsockname()[:2]
        print(f"kvmove-serve ready on http://{host}:{port} ({about})", flush=True)
    await serving
    return 0 if server.started else 1


def _connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                            max_connections=args.max_connections)


def _proxy_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  argv: list[str] | None) -> ProxyConfig | None:
    """The vLLM proxy's config when ``--vllm-*`` is given; None for the engine's serve.
    A misuse exits with status 2, as argparse's own errors do."""
    if args.vllm_prefill is None and args.vllm_decode is None:
        if args.kv_mode is not None:
            parser.error("--kv-mode needs --vllm-prefill and --vllm-decode")
        return None
    if args.vllm_prefill is None or args.vllm_decode is None:
        parser.error("--vllm-prefill and --vllm-decode go together")
    probe = _parser()  # which engine flags were given, whatever their value
    probe.set_defaults(**{dest: _UNSET for dest in _ENGINE_ONLY})
    given = [d for d in _ENGINE_ONLY if getattr(probe.parse_args(argv), d) is not _UNSET]
    if given:
        flags = ", ".join("--" + d.replace("_", "-") for d in given)
        parser.error(f"{flags}: kvmove's own engine workers' flags, which do not combine "
                     "with --vllm-prefill/--vllm-decode (vLLM runs the model)")
    return ProxyConfig(
        prefill=tuple(args.vllm_prefill), decode=tuple(args.vllm_decode),
        kv_mode=TransferMode(args.kv_mode or TransferMode.PUSH), routing=args.routing,
        host=args.host, port=args.port,
        request_timeout=args.request_timeout, max_pending=args.max_pending,
        max_body_bytes=args.max_body_bytes, connections=_connection_limits(args),
        log_level=log_level(args.log_level),
        allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(","))
        if args.allowed_hosts is not None else None)


def _ray_resources(parser: argparse.ArgumentParser,
                   given: list[str] | None) -> dict[str, dict[str, float]] | None:
    """``--ray-resources ROLE=JSON ...`` as {role: {resource: amount}}."""
    if given is None:
        return None
    resources = {}
    for item in given:
        role, _, text = item.partition("=")
        try:
            amounts = json.loads(text)
        except json.JSONDecodeError as error:
            parser.error(f"--ray-resources {item!r}: not ROLE=JSON ({error})")
        if not isinstance(amounts, dict):
            parser.error(f"--ray-resources {item!r}: JSON must be an object of amounts")
        resources[role.strip()] = amounts
    return resources


def _bounds(text: str) -> Bounds:
    """``parse_bounds`` as an argparse type: its message, not "invalid parse_bounds value"."""
    try:
        return parse_bounds(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _store_disk_gb(args: argparse.Namespace) -> float:
    """--store-disk-gb, which sizes --store-dir's tier: refused without it (it was ignored)."""
    if args.store_disk_gb is None:
        return _DEFAULTS.store_disk_gb
    if args.store_dir is None:
        raise ConfigError("--store-disk-gb sizes the disk tier of --store-dir, which is not "
                          "given")
    return float(args.store_disk_gb)


def _check_transports(transports: str | None) -> None:
    """--transports that UCX cannot use here are a configuration error (exit 2), found
    before any worker starts: a throwaway agent's UCX context tries them. Not with --ray,
    whose workers may run on hosts with other devices."""
    if transports is None:
        return
    layout = kvmove.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                           block_size=4)
    try:
        kvmove.Agent("kvmove-serve-transports", kvmove.KVCache(layout, 1),
                     transports=transports).close()
    except UCXError as error:
        raise ConfigError(f"--transports {transports!r}: UCX cannot use them here "
                          f"({error})") from None


def _pair(bounds: Bounds | None) -> tuple[int, int] | None:
    return (bounds.low, bounds.high) if bounds is not None else None


# What the extras bring: missing at run time, the install lacks an extra (not a bug here).
_PROXY_MODULES = {"fastapi", "uvicorn", "prometheus_client", "httpx", "starlette", "pydantic",
                  "anyio", "h11", "msgspec", "pydantic_core"}
_SERVE_MODULES = _PROXY_MODULES | {"torch", "safetensors", "tokenizers", "jinja2", "ray"}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _main(parser, args, argv)
    except ModuleNotFoundError as error:
        proxy = args.vllm_prefill or args.vllm_decode
        if (error.name or "").split(".")[0] not in (_PROXY_MODULES if proxy else _SERVE_MODULES):
            raise
        extra, what = ("proxy", "--vllm-prefill/--vllm-decode") if proxy else (
            "serve,ray" if args.ray else "serve", "serving the engine")
        print(f"kvmove-serve: error: {what} needs kvmove's {extra!r} extra: pip install "
              f"'kvmove[{extra}]' (missing module {error.name!r})", file=sys.stderr)
        return 2


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace,
          argv: list[str] | None) -> int:
    try:
        proxy = _proxy_config(parser, args, argv)
        if proxy is not None:
            _setup_logging(proxy.log_level)
            return asyncio.run(_serve_proxy(proxy))
        config = ServeConfig(
            mode=args.mode, routing=args.routing, workers=args.workers, prefill=args.prefill,
            decode=args.decode,
            model=args.model, chunk_size=args.chunk_size, num_blocks=args.num_blocks,
            block_size=args.block_size, max_num_seqs=args.max_num_seqs, host=args.host,
            port=args.port, agent_host=args.agent_host, net_devices=args.net_devices,
            key_file=args.key_file,
            transports=args.transports, request_timeout=args.request_timeout,
            transfer_timeout=args.transfer_timeout,
            pin_cpus=not args.no_pin_cpus, store_dir=args.store_dir,
            store_host_gb=args.store_host_gb, store_disk_gb=_store_disk_gb(args),
            checksums=not args.no_checksums, restart=not args.no_restart,
            log_level=log_level(args.log_level), max_pending=args.max_pending,
            max_body_bytes=args.max_body_bytes, connections=_connection_limits(args),
            planner=args.planner,
            prefill_bounds=_pair(args.prefill_workers), decode_bounds=_pair(args.decode_workers),
            planner_interval=args.planner_interval,
            allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(","))
            if args.allowed_hosts is not None else None,
            ray=args.ray, ray_resources=_ray_resources(parser, args.ray_resources))
        if not config.ray:  # Ray's workers may run on hosts with other devices than this
            _check_transports(config.transports)
        _setup_logging(config.log_level)
        return asyncio.run(_serve(config))
    except ConfigError as error:
        print(f"kvmove-serve: error: {error}", file=sys.stderr)
        return 2
    except KVMoveError as error:
        print(f"kvmove-serve: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
