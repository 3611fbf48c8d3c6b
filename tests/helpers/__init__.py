"""What the tests share: the far sides of two-process tests (classes a ``harness.Child`` hosts
in a spawned process), the bytes both processes agree on, assertions, the ``kvmove-serve``
process, and the convert references. ``tests/conftest.py`` makes ``helpers`` importable."""
