"""``kvmove-serve --vllm-prefill URL... --vllm-decode URL...``: the OpenAI API in front of vLLM
prefill and decode instances, speaking vLLM's P/D protocol (``kv_transfer_params``) to them.

The protocol is the one vLLM's NixlConnector toy proxy speaks, so this proxy and that one are
interchangeable in front of the same servers:

* **pull** (vLLM's flow): the client's body goes to a prefill instance with ``max_tokens`` 1,
  ``stream`` false and ``kv_transfer_params`` asking for a remote decode
  (``KVTransferParams.pull_request``);
  the ``kv_transfer_params`` it answers with go, unchanged, into the client's body to a decode
  instance, which pulls the KV; the decode's answer is the client's.
* **push** (kvmove's layer-wise flow): the decode instance reserves blocks first and the prefill
  streams each layer into them while it computes, so the decode request starts first and the
  prefill's runs alongside; both carry one ``kvmove_transfer_id``, and the decode's also the
  prefill instance's kvmove address. That address is known only from an earlier answer of the
  same prefill instance, so its first request goes the pull way (``pull-fallback``).

Both upstream requests carry the client's ``X-Request-Id`` (or a new one). Upstream failures
reach the client as OpenAI's error body naming the instance: 502 (unreachable, broken answer)
or 504 (no answer within ``--request-timeout``); an upstream's own refusal (a 400 for a prompt
too long) is passed through as it is.

Every ``kv_transfer_params`` the proxy writes or reads is a ``KVTransferParams``
(``kvmove.integrations.vllm.params``, shared with the connector), except the prefill's answer
in pull, which goes to the decode unchanged: it may be another connector's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvmove.integrations.vllm.params import KVTransferParams, TransferMode
from kvmove.serve.admission import Admission
from kvmove.serve.api import APIError, install_error_handlers
from kvmove.serve.vllm.kv_routing import EventSubscriber, Placement, event_endpoint, score
from kvmove.serve.vllm.pools import Instance, Pool, ProxyConfig, ProxyMetrics
from kvmove.serve.vllm.upstream import Call, Relay, UpstreamError

__all__ = ["Proxy", "create_app"]

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
HEALTH_SECONDS = 5.0  # one instance's /health (at most --request-timeout)
DISCOVER_SECONDS = 2.0  # between two asks of an instance's KV event sources
# What vLLM's /tokenize takes of a chat request (the rest does not change the prompt's tokens)
TOKENIZE_CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message",
                      "chat_template", "chat_template_kwargs", "tools")


def _prefill_body(body: dict, path: str, params: dict) -> dict:
    """The client's body as a prefill request: one token, no stream."""
    out = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}
    out.pop("stream_options", None)
    if path == CHAT_PATH:
        out["max_completion_tokens"] = 1
    return out


def _passed(upstream: httpx.Response, content: bytes, rid: str) -> Response:
    return Response(content, status_code=upstream.status_code, headers={"X-Request-Id": rid},
                    media_type=upstream.headers.get("content-type", "application/json"))


async def _json_object(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as error:
        raise APIError(400, f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


class Proxy:
    """The pools, the upstream client and the hand-off protocol."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefills = Pool.of("prefill", config.prefill)
        self.decodes = Pool.of("decode", config.decode)
        self.metrics = ProxyMetrics([self.prefills, self.decodes])
        self.client = httpx.AsyncClient()  # replaced in start(), inside the event loop
        self.background: set[asyncio.Task] = set()  # push prefills the client does not await
        # The prefill instances' KV events, kept whatever --routing says (as the own engine's
        # router does): kvmove_routing_matched_tokens then compares the two routings.
        self.events = EventSubscriber()
        self.placements: list[Placement] = []   # placed, prefill not ended (kv_routing.py)

    async def start(self) -> None:
        # trust_env False: an HTTP_PROXY meant for the internet must not catch our instances
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.request_timeout), trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._spawn(self._discover_events())

    async def stop(self) -> None:
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.client.aclose()
        self.events.close()

    async def _discover_events(self) -> None:
        """Subscribes to each prefill instance's KV events (vLLM's ``/kv_event_sources``),
        asking again every ``DISCOVER_SECONDS`` an instance that does not answer yet."""
        waiting = list(self.prefills.instances)
        while waiting:
            for instance in list(waiting):
                try:
                    reply = await self.client.get(instance.url + "/kv_event_sources",
                                                  timeout=HEALTH_SECONDS)
                    sources = reply.json() if reply.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    continue
                waiting.remove(instance)
                endpoints = [e for s in (sources or {}).values() if isinstance(s, dict)
                             if (e := event_endpoint(s, instance.url)) is not None]
                for endpoint in endpoints:
                    self.events.subscribe(instance.url, endpoint)
                if not endpoints:
                    log.info("prefill instance %s publishes no KV events it can be subscribed "
                             "to (vLLM's --kv-events-config with a \"tcp://*:PORT\" or ipc:// "
                             "endpoint): KV routing sees nothing of it", instance.url)
            if waiting:
                await asyncio.sleep(DISCOVER_SECONDS)

    async def _place(self, body: dict, path: str, headers: dict[str, str]
                     ) -> tuple[Instance, Placement | None]:
        """The prefill instance for a request (``--routing``; kv_routing.py), and what it
        now counts there until its prefill ends. By load (the pool's own pick, no
        tokenizing: the least-loaded baseline pays nothing for kv's lookups) with
        ``--routing least-loaded``, when no instance's KV events are known, or when the
        prompt cannot be tokenized."""
        if self.config.routing != "kv" or not self.events.subscribed:
            instance = self.prefills.pick()
            self.metrics.routed.labels(instance.url, "least_loaded").inc()
            return instance, None
        order = self.prefills.rotation()
        tokens = await self._tokenize(body, path, headers, order[0])
        if tokens is None:
            instance = self.prefills.pick()
            self.metrics.routed.labels(instance.url, "least_loaded").inc()
            return instance, None
        decision, hashes = score(self.events, order, tokens, self.placements)
        instance = next(i for i in order if i.url == decision.name)
        self.prefills.picked(instance)
        self.metrics.routed.labels(decision.name, decision.reason).inc()
        self.metrics.matched.observe(decision.matched_tokens)
        placement = Placement(instance.url, set(hashes), decision.uncached_tokens)
        self.placements.append(placement)
        return instance, placement

    async def _tokenize(self, body: dict, path: str, headers: dict[str, str],
                        instance: Instance) -> list[int] | None:
        """The prompt's token ids, as vLLM makes them (its ``/tokenize``: the model's
        tokenizer and chat template); None when it cannot say."""
        prompt = body.get("prompt")
        if path == COMPLETIONS_PATH and isinstance(prompt, list) and prompt and \
                all(isinstance(t, int) for t in prompt):
            return prompt
        if path == COMPLETIONS_PATH and isinstance(prompt, str):
            ask: dict[str, Any] = {"prompt": prompt}
        elif path == CHAT_PATH and isinstance(body.get("messages"), list):
            ask = {key: body[key] for key in TOKENIZE_CHAT_KEYS if key in body}
        else:
            return None   # a batch of prompts: routed by load
        ask["model"] = body.get("model")
        try:
            reply = await self.client.post(instance.url + "/tokenize", json=ask,
                                           headers=headers, timeout=HEALTH_SECONDS)
            tokens = reply.json().get("tokens") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            tokens = None
        return tokens if isinstance(tokens, list) else None

    def _placed(self, placement: Placement | None) -> None:
        """``placement``'s prefill ended (or failed)."""
        if placement is not None and placement in self.placements:
            self.placements.remove(placement)

    def export_index(self) -> None:
        """The index's size per instance and medium, for ``/metrics``."""
        for instance in self.prefills.instances:
            for medium, count in self.events.counts(instance.url).items():
                self.metrics.indexed.labels(instance.url, medium).set(count)

    async def complete(self, request: Request, path: str) -> Response:
        try:
            body = await _json_object(request)
        except APIError:
            self.metrics.rejected.labels("400").inc()
            raise
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if "authorization" in request.headers:  # vLLM started with --api-key checks it
            headers["Authorization"] = request.headers["authorization"]
        prefill, placement = await self._place(body, path, headers)
        log.debug("%s %s: prefill %s (kvmove address %s)", rid, path, prefill.url,
                  prefill.address)
        if self.config.kv_mode is TransferMode.PUSH and prefill.address is not None:
            self.metrics.handoffs.labels(TransferMode.PUSH.value).inc()
            return await self._push(path, body, headers, prefill, placement)
        pull = self.config.kv_mode is TransferMode.PULL
        self.metrics.handoffs.labels(TransferMode.PULL.value if pull else "pull-fallback").inc()
        return await self._pull(path, body, headers, prefill, placement)

    async def _pull(self, path: str, body: dict, headers: dict[str, str],
                    prefill: Instance, placement: Placement | None = None) -> Response:
        call = self._call(prefill)
        try:
            upstream = await call.open("POST", path, _prefill_body(
                body, path, KVTransferParams.pull_request()), headers)
            content = await call.read(upstream)
        finally:
            self._placed(placement)
        if not upstream.is_success:  # its refusal (prompt too long...) is the client's answer
            return _passed(upstream, content, headers["X-Request-Id"])
        params = self._kv_params(call, content)
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        decode = self._call(self.decodes.pick())
        upstream = await decode.open("POST", path, decode_body, headers)
        return await self._answer(decode, upstream, body, headers, None)

    def _kv_params(self, call: Call, content: bytes) -> dict | None:
        """The ``kv_transfer_params`` of a prefill's answer (and its kvmove address, kept)."""
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            call.count("protocol")
            raise UpstreamError(502, f"prefill instance {call.instance.url} answered with no "
                                     f"JSON object: {content[:200]!r}", kind="upstream_error")
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            call.count("no_kv_params")  # once in the log, every time in the metrics
            level = logging.DEBUG if call.instance.warned else logging.WARNING
            call.instance.warned = True
            log.log(level, "prefill instance %s returned no kv_transfer_params (is its vLLM "
                    "running a KV connector?): the decode instance computes the prompt "
                    "itself", call.instance.url)
            return None
        call.instance.learn_address(params)
        return params

    async def _push(self, path: str, body: dict, headers: dict[str, str],
                    prefill: Instance, placement: Placement | None = None) -> Response:
        """The decode request first (its body on the wire, not its answer: the decode's
        connector reserves the blocks the prefill's layers land in), then the prefill's."""
        assert prefill.address is not None
        tid = uuid.uuid4().hex
        to_decode = dataclasses.replace(prefill.address, do_remote_prefill=True,
                                        do_remote_decode=False, transfer_mode=TransferMode.PUSH,
                                        kvmove_transfer_id=tid)
        to_prefill = KVTransferParams(do_remote_decode=True, do_remote_prefill=False,
                                      transfer_mode=TransferMode.PUSH, kvmove_transfer_id=tid)
        decode_body = {**body, "kv_transfer_params": to_decode.to_dict()}
        prefill_body = _prefill_body(body, path, to_prefill.to_dict())
        decode = self._call(self.decodes.pick())
        sent = asyncio.Event()
        opening = asyncio.create_task(decode.open("POST", path, decode_body, headers, sent))
        task: asyncio.Task | None = None
        try:
            await sent.wait()  # open() sets it whatever happens
            task = self._spawn(self._push_prefill(prefill, path, prefill_body, headers))
            task.add_done_callback(lambda _: self._placed(placement))
            return await self._answer(decode, await opening, body, headers, task)
        except BaseException:  # no decode to push into (or no client): the prefill is moot
            opening.cancel()
            if task is not None:
                task.cancel()
            self._placed(placement)
            raise

    async def _push_prefill(self, prefill: Instance, path: str, body: dict,
                            headers: dict[str, str]) -> None:
        """A push's prefill request. Its failure is logged and counted, never the client's:
        the decode's connector gives the hand-off up at its deadline and vLLM recomputes."""
        call = self._call(prefill)
        try:
            upstream = await call.open("POST", path, body, headers)
            content = await call.read(upstream)
        except UpstreamError as error:
            log.warning("push prefill failed, the decode instance recomputes: %s", error)
            return
        if not upstream.is_success:
            log.warning("prefill instance %s refused a push prefill with %d: %r", prefill.url,
                        upstream.status_code, content[:200])
            return
        try:
            prefill.learn_address(json.loads(content).get("kv_transfer_params"))
        except (ValueError, AttributeError):
            call.count("protocol")

    async def _answer(self, call: Call, upstream: httpx.Response, body: dict,
                      headers: dict[str, str], prefill: asyncio.Task | None) -> Response:
        rid = headers["X-Request-Id"]
        if body.get("stream") is True and upstream.is_success:
            return Relay(call, upstream, rid, prefill)
        return _passed(upstream, await call.read(upstream), rid)

    def _call(self, instance: Instance) -> Call:
        return Call(self.client, self.metrics, self.config.request_timeout, instance)

    def _spawn(self, coroutine: Any) -> asyncio.Task:
        task = asyncio.create_task(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def models(self) -> Response:
        call = self._call(self.decodes.pick())
        upstream = await call.open("GET", "/v1/models")
        return _passed(upstream, await call.read(upstream), uuid.uuid4().hex)

    async def health(self) -> JSONResponse:
        """200 when every instance's ``/health`` answers 200, else 503 naming the others."""
        instances = [*self.prefills.instances, *self.decodes.instances]
        problems = await asyncio.gather(*(self._check(i) for i in instances))
        failing = {i.url: p for i, p in zip(instances, problems) if p is not None}
        report: dict[str, Any] = {
            "status": "unhealthy" if failing else "ok",
            "instances": {i.url: {"pool": i.pool, "in_flight": i.in_flight,
                                  "kvmove_address": i.address and i.address.to_dict()}
                          for i in instances}}
        if failing:
            report["failing"] = failing
        return JSONResponse(report, status_code=503 if failing else 200)

    async def _check(self, instance: Instance) -> str | None:
        timeout = min(HEALTH_SECONDS, self.config.request_timeout)
        try:
            response = await self.client.get(instance.url + "/health", timeout=timeout)
        except httpx.HTTPError as error:
            return f"{instance.pool} instance {instance.url}: {type(error).__name__} {error}"
        if response.status_code != 200:
            return f"{instance.pool} instance {instance.url}: /health {response.status_code}"
        return None


def create_app(proxy: Proxy) -> FastAPI:
    """The proxy's app; its lifespan starts and stops the upstream client."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        yield
        await proxy.stop()

    config = proxy.config
    app = FastAPI(title="kvmove-serve (vLLM proxy)", lifespan=lifespan)
    app.add_middleware(Admission, hosts=config.hosts(), max_body_bytes=config.max_body_bytes,
                       body_timeout=config.connections.body_timeout,
                       max_pending=config.max_pending, metrics=proxy.metrics)
    install_error_handlers(app)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await proxy.complete(request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await proxy.complete(request, CHAT_PATH)

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> JSONResponse:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        proxy.export_index()
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
