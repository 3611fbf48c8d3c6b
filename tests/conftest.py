"""The tests' import setup: pytest puts this folder (``tests/``, which is no package) at the
front of ``sys.path`` when it imports this file, so every test imports its helpers as
``helpers.<module>`` (``tests/helpers/``). A spawned child process gets the parent's
``sys.path``, so the classes a ``kvmove.bench.harness.Child`` hosts in a child
(``helpers.far.FarAgent`` and the others) import there the same way.
"""
