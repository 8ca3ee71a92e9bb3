"""The kvtier engine: mlx-lm generation with a tiered KV-cache store."""

from .blas import preload_openblas

preload_openblas()  # before anything imports mlx.core
