"""``kvmove.ucx_info()``: which UCX this process loaded and what it offers here, so that a user
sees why a run used tcp and not RDMA. The installed UCX is asked (its components, memory
domains and transport resources, as ``ucx_info -d``); the module folder and the summary are
also checked on a made-up UCX with RDMA modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvmove
from kvmove import runtime
from kvmove.runtime import UcxInfo

from helpers.kv import make_cache

LAYOUT = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)


def test_the_loaded_ucx_reports_itself():
    info = kvmove.ucx_info()
    assert info.version == kvmove.ucx_version()
    assert Path(info.library).name.startswith("libucp.so") and Path(info.library).exists()
    # every host has loopback tcp and UCX's self transport; shared memory on Linux
    assert {"tcp/lo", "posix/memory"} <= set(info.transports), info
    assert any(t.startswith("self/") for t in info.transports), info
    assert set(info.loaded) <= set(info.modules)
    assert info.rdma == any(m in runtime.RDMA_MODULES for m in info.modules)
    assert info.cuda == ("cuda" in info.modules)
    assert not info.rdma_devices or info.rdma   # no RDMA device without RDMA built in
    assert info.summary().startswith(f"UCX {info.version} from the {info.source} (")
    assert info.to_dict()["transports"] == list(info.transports)


def test_what_an_agent_uses_is_among_what_ucx_offers():
    with kvmove.Agent("a", make_cache(LAYOUT, 4), transports="tcp") as a, \
            kvmove.Agent("b", make_cache(LAYOUT, 4), transports="tcp") as b:
        a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        a.write("b", [0], [1]).wait(10.0)
        used = {f"{tl}/{dev}" for tl, dev in a.peer_transports("b")}
    assert used <= set(kvmove.ucx_info().transports), used
    # UCX before 1.14 cannot tell an endpoint's lanes (docs/transfer.md)
    assert used or _version() < (1, 14), used


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in kvmove.ucx_version().split(".")[:2])


def test_the_wheel_is_told_from_a_site_ucx(tmp_path: Path):
    pytest.importorskip("libucx")
    info = kvmove.ucx_info()
    assert (info.source == "libucx wheel") == runtime._in_libucx_wheel(info.library)
    site = tmp_path / "lib" / "libucp.so.0"
    site.parent.mkdir()
    site.touch()
    assert not runtime._in_libucx_wheel(str(site))
    assert not runtime._in_libucx_wheel("")


def test_modules_are_the_libuct_files_beside_the_library(tmp_path: Path):
    """A site UCX built with verbs and rdmacm (as MLNX OFED's or HPC-X's): its module folder
    holds libuct_ib and libuct_rdmacm, and the report says RDMA is built in."""
    lib = tmp_path / "lib"
    (lib / "ucx").mkdir(parents=True)
    (lib / "libucp.so.0").touch()
    for name in ("libuct_ib.so", "libuct_rdmacm.so", "libuct_cma.so", "libucm_cuda.so",
                 "libuct_ib.so.0"):
        (lib / "ucx" / name).touch()
    assert runtime._modules(str(lib / "libucp.so.0")) == ("cma", "ib", "rdmacm")
    assert runtime._modules(str(tmp_path / "nowhere" / "libucp.so")) == ()
    assert runtime._modules("") == ()


@pytest.mark.parametrize("transports, words", [
    (("rc_mlx5/mlx5_0:1", "tcp/ib0"), "RDMA built in, devices rc_mlx5/mlx5_0:1"),
    (("tcp/eth0",), "RDMA built in, no RDMA device here"),
])
def test_the_summary_says_why_rdma_was_not_used(transports, words):
    info = UcxInfo(version="1.22.0", library="/opt/ucx/lib/libucp.so.0", source="site",
                   modules=("cma", "ib", "rdmacm"), loaded=("cma", "ib"),
                   transports=transports, rdma=True, cuda=False)
    text = info.summary()
    assert text.startswith("UCX 1.22.0 from the site (/opt/ucx/lib/libucp.so.0)")
    assert words in text and "CUDA not built in" in text
    assert "rdmacm did not load here" in text
    wheel = UcxInfo(version="1.22.0", library="", source="libucx wheel", modules=("cma",),
                    loaded=("cma",), transports=("tcp/lo",), rdma=False, cuda=False)
    assert "RDMA not built in (no verbs/rdmacm modules)" in wheel.summary()
    assert wheel.summary().startswith("UCX 1.22.0 from the libucx wheel: transports tcp;")


@pytest.mark.skipif(not os.environ.get("KVMOVE_SITE_UCX_MODULES"),
                    reason="for .ci/site-ucx: kvmove built against a site UCX with verbs and "
                    "rdmacm (KVMOVE_SITE_UCX_MODULES names the modules it must load)")
def test_a_site_ucx_loads_its_rdma_modules_into_an_agents_process():
    """No RDMA device is needed for UCX to load its IB and rdmacm modules: an agent's context
    does, and ucx_info then says RDMA is built in, with no device here."""
    expected = set(os.environ["KVMOVE_SITE_UCX_MODULES"].split(","))
    with kvmove.Agent("a", make_cache(LAYOUT, 4)):
        loaded = runtime._loaded_modules()   # what the agent's context loaded
    assert expected <= loaded, loaded
    info = kvmove.ucx_info()
    assert info.source == "site" and info.rdma and expected <= set(info.modules), info
    assert "RDMA built in" in info.summary()


@pytest.mark.parametrize("loaded, built, refused", [
    ("1.22.0", "1.22", False), ("1.23.1", "1.22", False), ("1.13.1", "1.13", False),
    ("1.21.0", "1.22", True),    # older than the UCX it was compiled against
    ("1.12.1", "1.12", True),    # older than the oldest kvmove supports
])
def test_a_ucx_older_than_kvmove_needs_is_refused_naming_both(loaded, built, refused):
    problem = runtime.ucx_problem(loaded, built)
    assert (problem is not None) == refused
    if refused:
        assert f"loaded UCX {loaded}" in problem and f"compiled against {built}" in problem
        assert "oldest it supports is 1.13" in problem


@pytest.mark.parametrize("modules, kernel, expected", [
    (["nvidia", "nvidia_peermem"], "5.4.0", "nvidia-peermem"),
    (["nv_peer_mem"], "4.18.0-553.el8", "nvidia-peermem"),
    (["nvidia"], "6.8.0-45-generic", "dma-buf"),
    (["nvidia"], "5.4.0-150-generic", "none"),     # dma-buf needs 5.12 or later
    ([], "6.8.0", "none"),                          # no NVIDIA driver at all
])
def test_gpudirect_prerequisites_are_read_from_the_kernel(tmp_path, modules, kernel, expected):
    for name in modules:
        (tmp_path / "module" / name).mkdir(parents=True)
    assert runtime.gpudirect(str(tmp_path), kernel) == expected
    info = UcxInfo(version="1.22.0", library="", source="site", modules=("cuda", "ib"),
                   loaded=("cuda", "ib"), transports=(), rdma=True, cuda=True,
                   gpudirect=expected)
    assert f"GPUDirect RDMA: {expected}" in info.summary()
