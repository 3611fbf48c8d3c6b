"""kvmove's command-line tools (``kvmove-bench``)."""
