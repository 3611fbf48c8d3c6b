"""``kvmove-serve`` in a core install (``pip install kvmove``, no extras): its ``--help``
works, and running it names the extra to install (``proxy`` in front of vLLM, ``serve`` for
the engine) and exits 2, rather than a traceback. The extras' modules are hidden from a child
interpreter by an import hook, as if never installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.checks import WORKDIR

HIDE = """
import sys
from importlib.abc import MetaPathFinder
HIDDEN = {"fastapi", "uvicorn", "prometheus_client", "httpx", "starlette", "pydantic",
          "pydantic_core", "anyio", "h11", "torch", "safetensors", "tokenizers", "jinja2",
          "ray"}
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
