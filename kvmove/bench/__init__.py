"""``kvmove-bench``'s benchmarks and planner: tools built on the library, not part of it.

One benchmark, one module: ``transfer``, ``stream``, ``engine``, ``store``, ``serve`` and
``plan`` each hold their measuring and their subcommand (``add_parser``, ``run_command``).
Where one module would grow past 500 lines, or must not import torch, its parts sit beside
it as ``<benchmark>_<part>.py`` (``transfer_report``, ``stream_report``, ``engine_rig``,
``serve_load``, ``serve_server``, ``serve_report``). ``cli`` assembles the subcommands;
``report`` and ``options`` hold what they share; ``peer`` is the far side of ``transfer`` and
``stream``; ``harness`` is the one way a benchmark (or a test) runs an object in a child
process; ``perftest`` is the ``ucx_perftest`` baseline; ``engine_caches`` allocates each
engine's KV tensors and wraps them (``transfer --wrap``, and the tests' engines).

The library (``kvmove/*.py``, ``kvmove.store``) and ``kvmove.engine`` never import this
package; the benchmarks may import them, and ``kvmove.serve``.
"""
