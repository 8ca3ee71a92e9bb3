"""kvtier's check on every architecture of the installed mlx-lm: each one that builds from
a small config (the tests' generated models' where they have one, else a generic one;
random weights, nothing loaded) gets its ``make_cache`` (or the
default cache), a one-token forward pass and ``LoadedModel.geometry``, the check
``kvtier run`` and ``kvtier serve`` make first. One line per architecture: the caches it
builds, then ``served`` with the layer kinds the namespace digests, or the one-line
refusal. An architecture whose config this script cannot guess prints ``not built`` and
why; read its ``make_cache`` (DESIGN §3a lists what it builds).

    python bench/cache_kinds.py [ARCHITECTURE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pkgutil
import sys
from collections import Counter
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx_lm.models
from mlx_lm.models.cache import CacheList, make_prompt_cache

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtier.engine.models.load import LoadedModel, ModelError  # noqa: E402
from tests.engine.kind_models import CONFIGS  # noqa: E402

GEMMA_ONLY = ("model_type", "query_pre_attn_scalar", "sliding_window_pattern")
BASE = {  # the tests' gemma3_text sizes, under the names most architectures use
    **{name: value for name, value in CONFIGS["gemma3_text"].items() if name not in GEMMA_ONLY},
    "rms_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
NOT_MODELS = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "ssm", "gated_delta", "mla"}


def guess(field: dataclasses.Field) -> object:
    """A small value for a required config field, by its type and name."""
    kind, name = str(field.type), field.name
    if "bool" in kind:
        return False
    if "float" in kind:
        return 1e-5 if "eps" in name else 1.0
    if "int" in kind and "ist" not in kind:
        if any(s in name for s in ("per_tok", "group", "shared", "offset", "first_k", "n_routed", "freq")):
            return 1
        return 2 if any(s in name for s in ("num_", "period", "step", "n_")) else 32
    if "dict" in kind.lower():
        return {}
    return ("silu" if "act" in name else "default") if "str" in kind else None


def caches(cache: list) -> str:
    def name(c: object) -> str:
        if isinstance(c, CacheList):
            return "CacheList(" + ",".join(type(x).__name__ for x in c.caches) + ")"
        keep = getattr(c, "keep", None)
        return type(c).__name__ + (f"(window={c.max_size},keep={keep})" if keep is not None else "")

    return " ".join(f"{n}x{k}" for k, n in Counter(name(c) for c in cache).items())


def check(architecture: str) -> str:
    try:
        module = importlib.import_module(f"mlx_lm.models.{architecture}")
        config = {"tie_word_embeddings": True, **CONFIGS[architecture]} if architecture in CONFIGS else dict(BASE)
        config.setdefault("model_type", architecture)
        for field in dataclasses.fields(module.ModelArgs):
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if required and field.name not in config:
                config[field.name] = guess(field)
        model = module.Model(module.ModelArgs.from_dict(config))
        built = caches(make_prompt_cache(model))
    except BaseException as err:  # an architecture's own checks, imports that exit, configs it rejects
        return f"not built ({type(err).__name__}: {str(err)[:80]})"
    try:
        geometry = LoadedModel(architecture, Path(), architecture, model, None, "").geometry(16)
    except ModelError as err:
        return f"{built}\trefused: {err}"
    except Exception as err:  # the guessed config does not run (not kvtier's check)
        return f"{built}\tnot run ({type(err).__name__}: {str(err)[:80]})"
    return f"{built}\tserved: {geometry.describe_layers() or 'kv'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architectures", nargs="*", help="default: every one mlx-lm has")
    args = parser.parse_args()
    every = sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in NOT_MODELS)
    for architecture in args.architectures or every:
        print(f"{architecture}\t{check(architecture)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
