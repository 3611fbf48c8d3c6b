"""``kvmove-serve`` in a core install (``pip install kvmove``, no extras): its ``--help``
works, and running it names the extra to install (``proxy`` in front of vLLM, ``serve`` for
the engine) and exits 2, rather than a traceback. The extras' modules are hidden from a child
interpreter by an import hook, as if never installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.checks import WORKDIR

HIDE = """
import sys
from importlib.abc import MetaPathFinder
HIDDEN = {"fastapi", "uvicorn", "prometheus_client", "httpx", "starlette", "pydantic",
          "pydantic_core", "anyio", "h11", "torch", "safetensors", "tokenizers", "jinja2",
          "ray", "msgspec"}
class Hide(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
from kvmove.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE, *args], capture_output=True, text=True,
                          timeout=60, cwd=WORKDIR)


def test_help_works_without_the_extras() -> None:
    run = serve("--help")
    assert run.returncode == 0, run.stderr
    assert "--vllm-prefill" in run.stdout and "--kv-mode" in run.stdout


@pytest.mark.parametrize(("args", "extra"), [
    (["--vllm-prefill", "http://127.0.0.1:1", "--vllm-decode", "http://127.0.0.1:2"], "proxy"),
    ([], "serve"),
])
def test_running_without_the_extras_names_the_one_to_install(args: list[str],
                                                            extra: str) -> None:
    run = serve(*args)
    assert run.returncode == 2, run.stderr
    assert f"pip install 'kvmove[{extra}]' (missing module" in run.stderr
    assert "Traceback" not in run.stderr


PROXY_IMPORTS = """
import json, sys
from importlib.abc import MetaPathFinder
class NoTorch(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("torch is hidden", name=name)
sys.meta_path.insert(0, NoTorch())
from kvmove.serve.vllm.proxy import Proxy, create_app
from kvmove.serve.vllm.proxy_config import ProxyConfig
create_app(Proxy(ProxyConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",))))
print(json.dumps(sorted(m.__file__ for name, m in sys.modules.items()
                        if name.split(".")[0] == "kvmove" and getattr(m, "__file__", None)
                        and m.__file__.endswith(".py"))))
"""


def test_the_proxy_runs_without_torch_on_declared_packages_only() -> None:
    """The proxy in front of vLLM (the ``proxy`` extra): it builds its app with torch hidden,
    and every package kvmove's modules loaded for it import is the core's or the proxy
    extra's."""
    import ast
    import importlib.metadata
    import json
    import tomllib

    run = subprocess.run([sys.executable, "-c", PROXY_IMPORTS], capture_output=True,
                         text=True, timeout=120, cwd=WORKDIR)
    assert run.returncode == 0, run.stderr
    tops: set[str] = set()
    for path in json.loads(run.stdout):   # what they import when loaded (module level)
        for node in _module_level(ast.parse(Path(path).read_text()).body):
            if isinstance(node, ast.Import):
                tops |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops.add(node.module.split(".")[0])
    third_party = tops - set(sys.stdlib_module_names) - {"kvmove", "__future__", "vllm"}
    dists = importlib.metadata.packages_distributions()
    imported = {d.lower().replace("_", "-") for top in third_party
                for d in dists.get(top, [top])}
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    declared = {_dist(req) for req in project["dependencies"] +
                project["optional-dependencies"]["proxy"]}
    assert "torch" not in declared
    assert imported <= declared, f"undeclared: {sorted(imported - declared)}"


def _dist(requirement: str) -> str:
    import re

    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _module_level(body: list) -> list:
    """The statements a module runs when imported: its body, and the bodies of its
    module-level ``try`` and ``if`` blocks, but not ``if TYPE_CHECKING:``."""
    import ast

    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.Try):
            out += _module_level(node.body + node.orelse + node.finalbody +
                                 [s for h in node.handlers for s in h.body])
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            out += _module_level(node.body + node.orelse)
    return out
