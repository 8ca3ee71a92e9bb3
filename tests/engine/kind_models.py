"""Small generated models whose mlx-lm caches are not a plain ``KVCache`` per layer.

Each is written in the standard mlx-lm layout (``config.json``, ``model.safetensors``
and the kvtier-tiny tokenizer files) and loaded through ``mlx_lm.load`` like any model
directory. Weights are deterministic random (one RNG stream per parameter name), scaled
so that outputs depend on the context. Sizes are tiny so each test runs in seconds:

- ``gemma3_text``: sliding-window layers (``RotatingKVCache``, window 32) with a global
  layer every second layer (``KVCache``);
- ``gemma4_text``: Gemma 4's layout: window layers of 32-wide heads, global layers
  of two 64-wide heads whose keys are their values (``attention_k_eq_v``), and the
  last layers sharing earlier layers' KV (no cache of their own);
- ``gpt_oss``: attention sinks (a learned logit per head that every query also
  attends to) in window and global layers, and a mixture of experts;
- ``deepseek_v3``: multi-head latent attention, a ``KVCache`` per layer whose keys
  (the 32-wide latent) and values (the 16-wide rope part) differ in width, and a
  mixture-of-experts layer after a dense one;
- ``deepseek_v32``: the same with a lightning indexer (sparse attention over the top 8
  keys): a ``CacheList`` per layer of the latent's cache and the indexer's 16-wide keys,
  rows of two shapes in one kind;
- ``lfm2``: a recurrent hybrid, short-convolution layers (``ArraysCache``: one state
  array of the last ``conv_L_cache - 1`` inputs) between attention layers;
- ``falcon_h1``: a ``CacheList`` (Mamba-2 state and KV) per layer;
- ``recurrent_gemma``: recurrent blocks (``ArraysCache``) and sliding-window attention
  blocks (``RotatingKVCache``), no global layer;
- ``baichuan_m1``: a ``CacheList`` per layer of a short-convolution state over K/V
  (``ArraysCache``) and a window or global KV cache;
- ``mamba`` (recurrent layers only) and ``llama4`` (chunked-attention layers,
  ``ChunkedKVCache``, which mlx-lm's ``BatchGenerator`` cannot batch): refused, the
  kind named.
"""

from __future__ import annotations

import importlib
import json
import shutil
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine
from kvtier.engine.models.defaults import EOS_TOKEN_ID, ensure_default_model

_VOCAB = 259  # the kvtier-tiny byte tokenizer: 256 bytes and 3 specials
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

CONFIGS = {
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "vocab_size": _VOCAB,
    },
    "gemma4_text": {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
        "head_dim": 32,
        "global_head_dim": 64,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": _VOCAB,
        "use_double_wide_mlp": False,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "vocab_size": _VOCAB,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "head_dim": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "first_k_dense_replace": 1,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
    },
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 4096,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    },
    "falcon_h1": {
        "model_type": "falcon_h1",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_d_head": 16,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
    },
    "recurrent_gemma": {
        "model_type": "recurrent_gemma",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "attention_bias": False,
        "conv1d_width": 4,
        "logits_soft_cap": 30.0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_window_size": 32,
        "lru_width": 64,
        "block_types": ["recurrent", "recurrent", "attention"],
    },
    "baichuan_m1": {
        "model_type": "baichuan_m1",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "rope_theta": 10000.0,
        "sliding_window": 32,
        "sliding_window_layers": [0, 2],
        "conv_window": 2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "mamba": {
        "model_type": "mamba",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "state_size": 16,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 8,
    },
    "llama4": {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": 32,
            "head_dim": 32,
            "hidden_size": 64,
            "interleave_moe_layer_step": 2,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "max_position_embeddings": 4096,
            "num_attention_heads": 2,
            "num_experts_per_tok": 1,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "num_local_experts": 2,
            "rms_norm_eps": 1e-5,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "use_qk_norm": True,
            "vocab_size": _VOCAB,
        },
    },
}

CONFIGS["deepseek_v32"] = {
    **CONFIGS["deepseek_v3"],
    "model_type": "deepseek_v32",
    "q_lora_rank": 32,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
}


def _weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([7, zlib.crc32(name.encode())])
    if "norm" in name:
        return np.ones(shape, np.float32)
    w = rng.standard_normal(shape).astype(np.float32)
    return w if "embed" in name else w * np.float32(2.0 / np.sqrt(shape[-1]))


def write_model(directory: Path, architecture: str, **sizes: object) -> Path:
    """Write the generated ``architecture`` model into ``directory``, its config's
    ``sizes`` changed (a bench sizes one like a real model); returns it."""
    config = {"tie_word_embeddings": True, **CONFIGS[architecture], **sizes, "eos_token_id": EOS_TOKEN_ID}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name in _TOKENIZER_FILES:
        shutil.copy(ensure_default_model() / name, directory / name)
    module = importlib.import_module(f"mlx_lm.models.{architecture}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {name: mx.array(_weight(name, tuple(p.shape))) for name, p in tree_flatten(model.parameters())}
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    return directory


def restoring_wins(engine: Engine) -> Engine:
    """Prefill priced at 1 s a token, not learned online: every stored prefix is restored
    (a tiny model computes so fast that a learned profile may rightly recompute)."""
    engine.profile = Profile(Profile.defaults().links, ComputeModel([0.0, 1.0, 0.0]))
    engine.profile.compute.observe = lambda *args, **kwargs: None
    return engine
