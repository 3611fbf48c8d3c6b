"""``kvmove-bench``'s benchmarks and planner: tools built on the library, not part of it.

The library (``kvmove/*.py``, ``kvmove.store``) and ``kvmove.engine`` never import this
package; the benchmarks may import them, and ``kvmove.serve``.
"""
