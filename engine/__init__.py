"""The kvtier engine: mlx-lm generation with a tiered KV-cache store."""
