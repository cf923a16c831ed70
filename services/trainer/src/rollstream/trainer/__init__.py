"""rollstream trainer: feeds prompts, trains GRPO on scored rollouts, publishes weight deltas."""

from rollstream.core import cpu_runtime

# Before anything here imports torch (which starts OpenMP): on shared cores spinning OpenMP
# threads starve the other processes' (core/cpu_runtime.py).
cpu_runtime.passive_openmp()
