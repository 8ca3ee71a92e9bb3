"""kvtier: a tiered KV-cache offload store with a transfer cost model, and the MLX
engine that uses it.

The repository's top-level folders are this package's subpackages
(``kvtier.tiers``, ``kvtier.costmodel``, ``kvtier.engine``); layering points one way:
engine -> costmodel -> tiers.
"""

from kvtier.engine.blas import preload_openblas

preload_openblas()  # before anything imports mlx.core

__version__ = "0.2.0"


def __getattr__(name: str):
    """``from kvtier import Engine`` without importing mlx for ``import kvtier`` alone."""
    if name in ("Engine", "EngineConfig", "SamplingParams", "load_model", "StoreConfig", "TieredStore"):
        from kvtier.engine.engine import Engine, EngineConfig
        from kvtier.engine.models.load import load_model
        from kvtier.engine.request import SamplingParams
        from kvtier.tiers.hierarchy import StoreConfig, TieredStore

        exports = {
            "Engine": Engine,
            "EngineConfig": EngineConfig,
            "SamplingParams": SamplingParams,
            "load_model": load_model,
            "StoreConfig": StoreConfig,
            "TieredStore": TieredStore,
        }
        return exports[name]
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
