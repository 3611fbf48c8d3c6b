"""Every path the docs and the code name exists: a reader who follows ``csrc/stream/...`` or
``kvmove/serve/...`` from the README, ``docs/``, a file header or a comment finds that file.

Checked: ``README.md``, ``CHANGELOG.md`` is not (it records what was), ``docs/*.md``, and every
source file of ``csrc/``, ``bindings/``, ``kvmove/``, ``tests/``, ``bench/``, ``fuzz/`` and
``.ci/``. A path is a run of ``csrc/``, ``kvmove/``, ``tests/``, ``bench/``, ``bindings/``,
``fuzz/``, ``docs/`` or ``.ci/`` followed by path characters; inside ``csrc/`` a C++ include
path (``stream/stream_port.h``) counts too, relative to ``csrc/``. A glob (``csrc/**/*.cu``)
must match something.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("csrc", "kvmove", "tests", "bench", "bindings", "fuzz", "docs", ".ci")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w.*/-]*[\w*])")
CSRC_DIRS = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.is_dir())
CSRC_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(CSRC_DIRS)})/\w+\.(?:h|cpp|cu))\b")
SOURCES = ("*.py", "*.h", "*.cpp", "*.cu", "*.md", "*.sh", "run", "hardening", "vllm", "sglang",
           "lmcache")
# Where a path is not a path of this repository: another project's (vLLM's own tree), or a
# folder a command creates.
NOT_OURS = {"kvmove/_C.pyi", "docs/site"}


def _files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for top in ("csrc", "bindings", "kvmove", "tests", "bench", "fuzz", ".ci"):
        for pattern in SOURCES:
            files += sorted(p for p in (ROOT / top).rglob(pattern) if p.is_file())
    return sorted(set(files))


def _exists(path: str, base: Path) -> bool:
    path = re.sub(r"(?<=[\w.])\*+$", "", path).rstrip(".")  # markdown's **bold** is no glob
    if "*" in path:
        return any(base.glob(path))
    return (base / path).exists()


def _named(file: Path) -> list[tuple[str, Path]]:
    text = file.read_text(errors="replace")
    found = [(m.group(1), ROOT) for m in PATH.finditer(text)]
    if file.is_relative_to(ROOT / "csrc") or file.is_relative_to(ROOT / "bindings") or \
            file.is_relative_to(ROOT / "fuzz"):
        found += [(m.group(1), ROOT / "csrc") for m in CSRC_PATH.finditer(text)]
    return [(p, base) for p, base in found if p not in NOT_OURS]


@pytest.mark.parametrize("file", _files(), ids=lambda f: str(f.relative_to(ROOT)))
def test_every_path_a_file_names_exists(file: Path) -> None:
    missing = sorted({p for p, base in _named(file) if not _exists(p, base)})
    assert not missing, f"{file.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_check_finds_paths() -> None:
    """It reads what it should: the architecture page names files in every layer."""
    named = {p for p, _ in _named(ROOT / "docs" / "architecture.md")}
    assert any(p.startswith("csrc/") for p in named), named
    assert any(p.startswith("kvmove/") for p in named), named
