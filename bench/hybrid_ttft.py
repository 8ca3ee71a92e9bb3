"""TTFT of a long prompt on a sliding-window and a recurrent-hybrid model, restored from
each tier against recomputing it (issue 23, item 9).

    python bench/hybrid_ttft.py [--tokens 8192] [--page 256] [--models gemma3_text lfm2 ...] [--keep DIR]

``--keep DIR`` leaves the generated models in ``DIR/<architecture>`` (for example for
``bench/serve_head_to_head.py --model DIR/lfm2``, the agent workload against
``mlx_lm.server``); else they are written to a temporary directory.

Generated models (deterministic random weights, the mlx-lm layout, loaded with
``mlx_lm.load``) whose caches have the shapes of real ones, so that the bytes stored,
read and restored are a real model's (the first two by default):

- ``gemma3_text`` like Gemma 3 1B: 26 layers, 4 query heads, 1 KV head of 256, a 512-token
  sliding window on five layers of six, a global layer every sixth;
- ``lfm2`` like LFM2-1.2B: 16 layers, 10 short-convolution layers (state: the last 2
  inputs) and 6 attention layers of 8 KV heads of 64;
- ``gemma4_text`` like Gemma 4 E2B: 35 layers, the last 20 sharing earlier layers' KV;
  of the 15 with a cache, 12 sliding-window layers (512 tokens) of 1 KV head of 256 and
  3 global ones of 1 KV head of 512 (rows of two shapes: a flat page);
- ``deepseek_v3`` like DeepSeek-V2-Lite: 27 layers of multi-head latent attention, a
  512-wide latent and a 64-wide rope part per token (K and V side by side in a row).

Scaled down so that one run takes minutes on a shared 2-core CPU: the hidden sizes, query
heads and MLP widths (``SIZES``: prefill compute, which only makes recomputing cheaper
and the ratios conservative; lfm2's state, the last inputs of its hidden size, is a
quarter of a real one's), the vocabulary (the 259-token byte tokenizer), float32 weights
and KV (a real model's bf16 KV is half as many bytes). Each cell is one run of ``kvtier bench ttft``'s
measurement (``engine.bench_ttft.run``), reported as a ratio to recomputing in the same
run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtier.engine import bench_ttft  # noqa: E402
from kvtier.engine.models.load import load_model  # noqa: E402
from tests.engine.kind_models import write_model  # noqa: E402

SIZES = {
    "gemma3_text": {  # KV as Gemma 3 1B's; its hidden size 1152, 4 query heads, MLP 6912
        "hidden_size": 256,
        "num_hidden_layers": 26,
        "intermediate_size": 256,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
    },
    "lfm2": {  # KV as LFM2-1.2B's; its hidden size 2048 (32 query heads of 64), MLP 8192
        "hidden_size": 512,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "block_dim": 512,
        "block_ff_dim": 512,
        "layer_types": ["conv", "conv", "full_attention"] * 4 + ["conv", "full_attention", "conv", "full_attention"],
    },
    "gemma4_text": {  # KV as Gemma 4 E2B's; its hidden size 1536, 8 query heads, MLP 6144
        "hidden_size": 256,
        "num_hidden_layers": 35,
        "num_kv_shared_layers": 20,
        "intermediate_size": 256,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,
        "head_dim": 256,
        "global_head_dim": 512,
        "sliding_window": 512,
        "sliding_window_pattern": 5,
        "max_position_embeddings": 32768,
    },
    "deepseek_v3": {  # KV as DeepSeek-V2-Lite's; its hidden size 2048, 16 query heads, experts
        "hidden_size": 256,
        "num_hidden_layers": 27,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "max_position_embeddings": 32768,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--models", nargs="+", default=["gemma3_text", "lfm2"], choices=list(SIZES))
    parser.add_argument("--keep", type=Path, metavar="DIR", help="write the models here and leave them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-hybrid-ttft-") as tmp:
        models = args.keep or Path(tmp)
        for architecture in args.models:
            loaded = load_model(str(write_model(models / architecture, architecture, **SIZES[architecture])))
            g = loaded.geometry(args.page)
            kinds = ", ".join(sorted({k.describe() for k in g.kinds})) or "kv"
            print(f"{architecture}: {kinds}; KV {g.bytes_per_token} B a token, snapshot {g.snapshot_nbytes} B")
            t0 = time.perf_counter()
            report = bench_ttft.run(loaded, [args.tokens], args.page, Path(tmp) / f"{architecture}-store")
            (row,) = report["rows"]
            ttft = row["ttft_s"]
            cells = "  ".join(
                f"{s} {ttft[s]:.3f} s"
                + (f" ({row['ratio_to_recompute'][s]:.3f}x)" if s in row["ratio_to_recompute"] else "")
                for s in report["sources"]
            )
            print(f"  {args.tokens}-token prompt, page {args.page}: {cells}  [{time.perf_counter() - t0:.0f} s in all]")


if __name__ == "__main__":
    main()
