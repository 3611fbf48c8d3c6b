"""vLLM's P/D protocol as kvmove reads and writes it (``kvmove/integrations/vllm/params.py``)
and the connector's settings (``config.py``): no vLLM needed, as the proxy runs without it.

The wire is written out here (not imported): it is vLLM's, and must not drift.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvmove.errors import ConfigError
from kvmove.integrations.vllm.config import ConnectorConfig, KVRole, LoadPolicy
from kvmove.integrations.vllm.params import KVTransferParams, TransferMode, mark_handed_off

from helpers.checks import WORKDIR

# A kvmove prefill's answer (request_finished), as a decode receives it.
ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5],
          "remote_engine_id": "engine-0", "remote_request_id": "cmpl-1",
          "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1,
          "remote_num_tokens": 40, "transfer_mode": "pull"}


def test_an_answer_reads_back_field_for_field() -> None:
    params = KVTransferParams.from_request(ANSWER)
    assert params.to_dict() == ANSWER
    assert params.remote_block_ids == (4, 5) and params.transfer_mode is TransferMode.PULL
    assert (params.key, params.mode) == ("cmpl-1", TransferMode.PULL)
    assert params.agent_address == ("10.0.0.7", 5600)


def test_none_and_non_dicts_are_empty_params() -> None:
    raw: Any
    for raw in (None, {}, [], "push"):
        params = KVTransferParams.from_request(raw)
        assert params == KVTransferParams() and params.to_dict() == {}
        assert params.key is None and params.agent_address is None


def test_unknown_keys_are_ignored() -> None:
    params = KVTransferParams.from_request({**ANSWER, "remote_notify_port": 7})
    assert params.to_dict() == ANSWER


def test_the_flags_count_by_truthiness_as_in_vllms_connectors() -> None:
    params = KVTransferParams.from_request({"do_remote_prefill": 1, "do_remote_decode": ""})
    assert params.do_remote_prefill is True and params.do_remote_decode is False


@pytest.mark.parametrize("field, value", [
    ("remote_port", 0), ("remote_port", 65536), ("remote_port", True), ("remote_port", "5600"),
    ("remote_host", ""), ("remote_host", 7), ("remote_engine_id", None),
    ("remote_request_id", ""), ("remote_block_ids", [1, -1]), ("remote_block_ids", "1,2"),
    ("tp_size", 0), ("remote_num_tokens", -1), ("transfer_mode", "PUSH"),
    ("kvmove_transfer_id", "x" * 129), ("kvmove_transfer_id", ""),
])
def test_a_bad_field_is_dropped_and_the_others_kept(field: str, value: Any) -> None:
    """Client JSON must not fail vLLM's engine core: the connector computes instead."""
    params = KVTransferParams.from_request({**ANSWER, field: value})
    assert getattr(params, field) is None
    assert params.to_dict() == {k: v for k, v in ANSWER.items() if k != field}


@pytest.mark.parametrize("field, value, limit", [
    ("remote_port", 70000, "an int in [1, 65536)"),
    ("remote_host", "", "a non-empty string"),
    ("kvmove_transfer_id", "x" * 129, "a string of 1 to 128 characters"),
    ("transfer_mode", "both", "one of ['push', 'pull']"),
    ("do_remote_decode", 1, "true or false"),
    ("remote_block_ids", [0, -2], "a list of block ids"),
])
def test_the_constructor_refuses_a_bad_value_naming_it(field: str, value: Any,
                                                       limit: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        KVTransferParams(**{field: value})
    assert f"kv_transfer_params[{field!r}]" in str(excinfo.value)
    assert limit in str(excinfo.value) and repr(value)[:20] in str(excinfo.value)


def test_push_is_keyed_by_its_transfer_id_and_needs_one() -> None:
    push = {"do_remote_prefill": True, "transfer_mode": "push", "kvmove_transfer_id": "t1",
            "remote_request_id": "cmpl-1"}
    params = KVTransferParams.from_request(push)
    assert (params.transfer_id, params.key, params.mode) == ("t1", "t1", TransferMode.PUSH)
    # no (valid) transfer id: the pull way, by the prefill's request id
    params = KVTransferParams.from_request({**push, "kvmove_transfer_id": 5})
    assert (params.transfer_id, params.key, params.mode) == (None, "cmpl-1", TransferMode.PULL)
    # a transfer id without push asked
    params = KVTransferParams.from_request({**push, "transfer_mode": "pull"})
    assert params.transfer_id is None and params.key == "cmpl-1"


def test_a_pull_prefill_request_is_exactly_vllms_toy_proxys() -> None:
    assert KVTransferParams.pull_request() == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_the_prefill_address_needs_engine_host_and_port() -> None:
    address = KVTransferParams.from_request(ANSWER).prefill_address()
    assert address is not None and address.to_dict() == {
        "remote_engine_id": "engine-0", "remote_host": "10.0.0.7", "remote_port": 5600,
        "tp_size": 1}
    # the TP travels along when the prefill said it, and is not needed
    no_tp = {k: v for k, v in ANSWER.items() if k != "tp_size"}
    address = KVTransferParams.from_request(no_tp).prefill_address()
    assert address is not None and address.tp_size is None
    for field in ("remote_engine_id", "remote_host", "remote_port"):
        partial = {k: v for k, v in ANSWER.items() if k != field}
        assert KVTransferParams.from_request(partial).prefill_address() is None
    # the connector needs only host and port
    no_engine = {k: v for k, v in ANSWER.items() if k != "remote_engine_id"}
    assert KVTransferParams.from_request(no_engine).agent_address == ("10.0.0.7", 5600)


def test_handed_off_in_the_requests_own_dict() -> None:
    raw = dict(ANSWER)
    mark_handed_off(raw)
    assert raw == {**ANSWER, "do_remote_prefill": False}
    assert not KVTransferParams.from_request(raw).do_remote_prefill


def test_the_mode_is_the_wire_string() -> None:
    assert [m.value for m in TransferMode] == ["push", "pull"]
    assert f"{TransferMode.PUSH}" == "push" and TransferMode("pull") is TransferMode.PULL


def test_params_and_the_proxy_import_without_vllm() -> None:
    """The proxy runs where vLLM is not installed: neither it, the params nor the connector's
    package import vLLM (the connector class itself does, once vLLM asks for it)."""
    code = ("import sys; import kvmove.integrations.vllm, kvmove.integrations.vllm.params, "
            "kvmove.serve.vllm.proxy; print('vllm' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=WORKDIR)  # not the checkout: the installed kvmove
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ---- the connector's settings -----------------------------------------------------------------

def _vllm_config(role: str, port: int = 5600, tp: int = 1, rank: int = 0,
                 **extra: Any) -> Any:
    """The parts of vLLM's ``VllmConfig`` that ``ConnectorConfig.from_vllm`` reads; a
    ``data_parallel_rank`` (0.32) or ``data_parallel_index`` (newer) in ``extra`` goes to the
    parallel config."""
    parallel = {k: extra.pop(k) for k in ("data_parallel_rank", "data_parallel_index")
                if k in extra}
    kv = SimpleNamespace(kv_role=role, engine_id="e0", kv_port=port,
                         kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=kv,
                           parallel_config=SimpleNamespace(rank=rank, tensor_parallel_size=tp,
                                                           **parallel))


@pytest.mark.parametrize("field", ["data_parallel_rank", "data_parallel_index"])
def test_data_parallel_engines_listen_on_ports_of_their_own(field: str) -> None:
    """NixlConnector's placement: engine ``d``'s rank ``r`` on ``kv_port + d * tp + r``, so
    the ranks of two data-parallel engines on one host never share a port, and decodes are
    told each engine's rank-0 port."""
    ports = {}
    for dp in (0, 1, 2):
        for rank in (0, 1):
            config = ConnectorConfig.from_vllm(
                _vllm_config("kv_producer", port=5600, tp=2, rank=rank, **{field: dp}))
            ports[dp, rank] = config.listen_port
            assert config.engine_port == 5600 + 2 * dp
    assert ports == {(0, 0): 5600, (0, 1): 5601, (1, 0): 5602, (1, 1): 5603,
                     (2, 0): 5604, (2, 1): 5605}
    with pytest.raises(ConfigError, match=r"2 tensor-parallel ranks of data-parallel rank 1 "
                                          r"\(from 65535\), got 65533"):
        ConnectorConfig.from_vllm(_vllm_config("kv_producer", port=65533, tp=2,
                                               **{field: 1}))


def test_kv_role_is_an_enum_of_vllms_strings() -> None:
    for role in KVRole:
        config = ConnectorConfig.from_vllm(_vllm_config(role.value))
        assert config.role is role and config.role == role.value


def test_an_unknown_kv_role_is_refused_naming_the_roles() -> None:
    with pytest.raises(ConfigError, match=r"kv_role must be one of \['kv_producer', "
                                          r"'kv_consumer', 'kv_both'\], got 'kv_prefill'"):
        ConnectorConfig.from_vllm(_vllm_config("kv_prefill"))


@pytest.mark.parametrize("port, tp", [(0, 1), (65535, 2), (70000, 1)])
def test_a_prefill_needs_a_port_for_every_rank(port: int, tp: int) -> None:
    with pytest.raises(ConfigError, match=f"for each of the {tp} tensor-parallel ranks, "
                                          f"got {port}"):
        ConnectorConfig.from_vllm(_vllm_config("kv_producer", port=port, tp=tp))
    ConnectorConfig.from_vllm(_vllm_config("kv_consumer", port=port, tp=tp))  # unused there


def test_a_prefill_needs_a_host() -> None:
    with pytest.raises(ConfigError, match="'host'. must be an address, got ''"):
        ConnectorConfig.from_vllm(_vllm_config("kv_producer", host=""))


def test_load_policy_speaks_the_stores_words() -> None:
    """The connector's key and values are KVStore's (``load_policy``: auto, always; and
    never), checked as an enum."""
    config = ConnectorConfig.from_vllm(_vllm_config("kv_both", offload=True,
                                                    load_policy="never"))
    assert config.load_policy is LoadPolicy.NEVER
    assert ConnectorConfig.from_vllm(_vllm_config("kv_both")).load_policy is LoadPolicy.AUTO
    with pytest.raises(ConfigError, match=r"'load_policy'\]: input should be 'auto', "
                                          r"'always' or 'never', got 'sometimes'"):
        ConnectorConfig.from_vllm(_vllm_config("kv_both", load_policy="sometimes"))


@pytest.mark.parametrize(("rule", "policy"), [("measured", LoadPolicy.AUTO),
                                              ("always", LoadPolicy.ALWAYS),
                                              ("never", LoadPolicy.NEVER)])
def test_the_old_load_rule_key_still_works_with_a_warning(caplog, rule: str,
                                                          policy: LoadPolicy) -> None:
    """A config written for the old name keeps working (its value translated), and the log
    says the new name; both names at once, or an old value that never existed, are refused."""
    with caplog.at_level("WARNING", logger="vllm.kvmove.config"):
        config = ConnectorConfig.from_vllm(_vllm_config("kv_both", offload=True,
                                                        load_rule=rule))
    assert config.load_policy is policy
    assert "['load_rule'] is now 'load_policy'" in caplog.text
    with pytest.raises(ConfigError, match="both 'load_policy' and 'load_rule'"):
        ConnectorConfig.from_vllm(_vllm_config("kv_both", load_rule=rule, load_policy="auto"))
    with pytest.raises(ConfigError, match=r"'load_rule'\] \(now 'load_policy'\) must be one "
                                          r"of \['always', 'measured', 'never'\], got 'auto'"):
        ConnectorConfig.from_vllm(_vllm_config("kv_both", load_rule="auto"))


def test_net_devices_is_a_setting_of_its_own() -> None:
    """UCX's devices (an RDMA host's ``mlx5_0:1``), passed to each rank's agent; default None:
    ``$UCX_NET_DEVICES``, else the interface of ``host``."""
    assert ConnectorConfig.from_vllm(_vllm_config("kv_consumer")).net_devices is None
    config = ConnectorConfig.from_vllm(_vllm_config("kv_producer", net_devices="mlx5_0:1"))
    assert config.net_devices == "mlx5_0:1"
    with pytest.raises(ConfigError, match=r"'net_devices'\]: input should be a valid "
                                          r"string, got 1"):
        ConnectorConfig.from_vllm(_vllm_config("kv_producer", net_devices=1))


def test_vllms_kv_ip_is_the_host_unless_the_extra_config_names_one() -> None:
    """As NixlConnector users write it: ``kv_ip`` (vLLM's field) is where the agents serve; it
    was ignored, and the agents stayed on loopback."""
    config = _vllm_config("kv_producer")
    config.kv_transfer_config.kv_ip = "10.0.0.5"
    assert ConnectorConfig.from_vllm(config).host == "10.0.0.5"
    config = _vllm_config("kv_producer", host="10.0.0.6")
    config.kv_transfer_config.kv_ip = "10.0.0.5"
    assert ConnectorConfig.from_vllm(config).host == "10.0.0.6"
    assert ConnectorConfig.from_vllm(_vllm_config("kv_consumer")).host == "127.0.0.1"


def test_kv_both_is_either_role_as_nixlconnectors_and_offload_is_its_own_setting() -> None:
    """A NixlConnector config with the connector's name changed (``kv_both`` on both sides):
    P/D, serving prefills too (its agents listen); it silently meant offload. Offload is
    ``"offload": true``, with kv_both only."""
    both = ConnectorConfig.from_vllm(_vllm_config("kv_both"))
    assert both.serves_prefill and not both.offload
    assert not ConnectorConfig.from_vllm(_vllm_config("kv_consumer")).serves_prefill
    assert ConnectorConfig.from_vllm(_vllm_config("kv_producer")).serves_prefill
    offload = ConnectorConfig.from_vllm(_vllm_config("kv_both", offload=True))
    assert offload.offload and not offload.serves_prefill
    with pytest.raises(ConfigError, match="'offload'\\] needs kv_role 'kv_both'.*'kv_producer'"):
        ConnectorConfig.from_vllm(_vllm_config("kv_producer", offload=True))


def _docs_configs() -> list[dict[str, Any]]:
    """Every kvmove connector config docs/vllm.md shows: its ``json`` blocks and the
    ``--kv-transfer-config '...'`` of its commands, a MultiConnector's children included."""
    text = (Path(__file__).parent.parent / "docs" / "vllm.md").read_text()
    found = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)]
    found += [json.loads(arg) for arg in re.findall(r"--kv-transfer-config '(.*?)'", text, re.S)]
    configs = []
    for config in found:
        children = config.get("kv_connector_extra_config", {}).get("connectors")
        configs += children if config["kv_connector"] == "MultiConnector" else [config]
    return configs


def test_every_connector_config_in_the_vllm_docs_is_accepted() -> None:
    """A user copies these: each must name kvmove's connector and module, and its settings
    must be ones the connector takes (it refuses unknown keys, naming them)."""
    configs = _docs_configs()
    assert len(configs) >= 6, configs   # the P/D pair, NixlConnector's, MultiConnector's, offload
    for doc in configs:
        assert doc["kv_connector"] == "KVMoveConnector", doc
        assert doc["kv_connector_module_path"] == "kvmove.integrations.vllm", doc
        kv = SimpleNamespace(kv_role=doc["kv_role"], engine_id="e0",
                             kv_port=doc.get("kv_port", 5600),
                             kv_connector_extra_config=doc.get("kv_connector_extra_config", {}))
        vllm = SimpleNamespace(kv_transfer_config=kv, parallel_config=SimpleNamespace(
            rank=0, tensor_parallel_size=1))
        config = ConnectorConfig.from_vllm(vllm)
        assert config.role.value == doc["kv_role"]


@pytest.mark.parametrize(("key", "value", "message"), [
    ("load_timeout", "30", "input should be a valid number, got '30'"),
    ("load_timeout", 0, "input should be greater than 0, got 0"),
    ("lease_seconds", float("inf"), "input should be a finite number, got inf"),
    ("store_host_gb", True, "input should be a valid number, got True"),
    ("staging_blocks", 0, "input should be greater than 0, got 0"),
    ("staging_blocks", 2.5, "input should be a valid integer, got 2.5"),
    ("checksums", "yes", "input should be a valid boolean, got 'yes'"),
])
def test_extra_config_is_checked_strictly_naming_key_and_value(key: str, value: Any,
                                                                 message: str) -> None:
    """A pydantic model, strict as vLLM's own config: no string taken for a number, no bool
    for a count; the error names the key, the rule and the value."""
    with pytest.raises(ConfigError) as refused:
        ConnectorConfig.from_vllm(_vllm_config("kv_consumer", **{key: value}))
    assert str(refused.value) == f"kv_connector_extra_config[{key!r}]: {message}"


def test_an_unknown_key_is_refused_naming_the_keys_taken() -> None:
    with pytest.raises(ConfigError, match=r"unknown kv_connector_extra_config key\(s\) "
                                          r"\['load_timout'\]; kvmove's connector takes "
                                          r"\['checksums', 'host', "):
        ConnectorConfig.from_vllm(_vllm_config("kv_consumer", load_timout=5.0))
