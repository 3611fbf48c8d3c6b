"""The package as a user meets it: what it exports, and how it fails when it cannot load."""

from __future__ import annotations

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import kvmove

from helpers.checks import WORKDIR


def test_importing_a_checkout_without_the_compiled_core_says_so(tmp_path: Path) -> None:
    """A source tree imported instead of the installed package (e.g. ``python -m pytest`` from
    the repository root) has no ``kvmove._C``: the error names that, not a circular import."""
    source = Path(kvmove.__file__).parent
    shutil.copytree(source, tmp_path / "kvmove",
                    ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    # -S: no .pth files, so no editable install's finder hands out the development tree
    # whatever the working directory; site-packages (numpy, libucx) is added by hand.
    load = f"import sys; sys.path.extend({site.getsitepackages()!r}); import kvmove"
    result = subprocess.run([sys.executable, "-S", "-c", load], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "compiled core (kvmove._C) is not built" in result.stderr, result.stderr
    assert "pip install ." in result.stderr
    assert "circular import" not in result.stderr.splitlines()[-1]


def test_every_public_name_is_exported_and_documented() -> None:
    for name in kvmove.__all__:
        obj = getattr(kvmove, name)
        assert obj.__doc__, f"kvmove.{name} has no docstring"


def _reference_docstring(name: str) -> str:
    """The docstring the API reference shows: the object's own, or, for a core type bound to
    a module attribute (``TransferState = _C.TransferState``) or a constant
    (``TRAFFIC_CLASSES``), the string literal after that assignment (the compiled type's own
    docstring comes from C++; a tuple's is tuple's)."""
    import ast
    import inspect

    obj = getattr(kvmove, name)
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    if module is not None and not module.startswith("kvmove._C"):
        return inspect.getdoc(obj) or ""
    for module in ("agent", "stream", "transfer"):
        tree = ast.parse(Path(kvmove.__file__).with_name(f"{module}.py").read_text())
        for node, after in zip(tree.body, tree.body[1:]):
            if (isinstance(node, ast.Assign) and [t.id for t in node.targets] == [name]
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                return after.value.value
    return ""


def test_every_public_name_has_an_example_and_a_place_in_the_reference() -> None:
    """docs/api.md (mkdocs + mkdocstrings, built by .ci/run with warnings as errors) lists each
    name of ``kvmove.__all__``, and each docstring shows it in use."""
    reference = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    for name in kvmove.__all__:
        assert f"::: kvmove.{name}\n" in reference, f"kvmove.{name} is not in docs/api.md"
        assert "Example:" in _reference_docstring(name), f"kvmove.{name} has no example"


def test_public_classes_are_python_classes_over_the_core() -> None:
    """One way to expose a compiled type: a Python class holding the core object, never the
    core class itself, an alias of it or a subclass of it."""
    core_types = tuple(t for t in vars(kvmove._C).values() if isinstance(t, type))
    for name in ("Agent", "BlockPool", "KVCache", "Region", "Transfer", "SaveStream",
                 "LoadStream"):
        cls = getattr(kvmove, name)
        assert cls.__module__.startswith("kvmove."), (name, cls.__module__)
        assert not issubclass(cls, core_types), f"kvmove.{name} subclasses a core type"


def test_the_core_type_stubs_name_exactly_what_the_core_has() -> None:
    """kvmove/_C.pyi ships in the wheel so that the core's types check; regenerate it with
    pybind11-stubgen when the bindings change (this test says when)."""
    import ast

    stub = Path(kvmove.__file__).with_name("_C.pyi")
    assert stub.is_file(), "kvmove/_C.pyi is not installed beside the module"
    tree = ast.parse(stub.read_text())
    declared = {node.name for node in tree.body
                if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    actual = {name for name in dir(kvmove._C) if not name.startswith("_")}
    assert declared == actual, (f"missing from the stub: {sorted(actual - declared)}; "
                                f"not in the module: {sorted(declared - actual)}")


def test_a_process_that_imports_kvmove_and_torch_exits_cleanly() -> None:
    """The core's log pump (``kvmove/_log.py``) is stopped before the interpreter finalizes:
    a pump thread that came back from ``take_log`` during finalization aborted the process
    (exit code 134), which every ``kvmove-serve`` shutdown hit (its processes import torch).
    Five runs: the abort came from a race with the pump's 0.5 s poll."""
    pytest.importorskip("torch")
    for _ in range(5):
        result = subprocess.run([sys.executable, "-c", "import torch, kvmove"],
                                capture_output=True, text=True, cwd=WORKDIR,
                                timeout=120)
        assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
        assert "terminate called" not in result.stderr


def test_the_version_has_one_source() -> None:
    """kvmove/_version.py is the one place: kvmove.__version__ imports it, setuptools reads it
    (statically, the way pyproject's dynamic version says) and the installed metadata carries
    what setuptools read."""
    import importlib.metadata
    import tomllib

    from kvmove._version import __version__

    assert kvmove.__version__ == __version__
    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "kvmove._version.__version__"}
    try:
        dist = importlib.metadata.distribution("kvmove")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None or Path(dist.locate_file("kvmove/__init__.py")) != Path(kvmove.__file__):
        pytest.skip("this kvmove is a source tree without metadata of its own; an installed "
                    "package (CI's pip install) checks its metadata")
    assert dist.version == kvmove.__version__


def test_the_license_file_is_the_declared_apache_2() -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text
