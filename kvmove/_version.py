"""kvmove's version, in one place: ``kvmove.__version__``, the package metadata (pyproject's
``version = {attr = "kvmove._version.__version__"}``, which setuptools reads without importing
the package) and the CLIs' ``--version`` all come from here."""

__version__ = "0.1.0"
