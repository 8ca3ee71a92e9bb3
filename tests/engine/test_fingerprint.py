"""The model fingerprint that starts every page's namespace changes whenever the weights
do, including when they are rewritten in place with their size and mtime kept (what
``rsync -a --inplace`` of another checkpoint of the same shape does)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvtier.engine.models.load import model_fingerprint
from kvtier.tiers.page import Namespace


def _namespace(model: Path) -> bytes:
    return Namespace(model_fingerprint(model), "float32", 16).digest()


def _model(directory: Path, seed: int) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    weights = np.random.default_rng(seed).standard_normal((64, 64), dtype=np.float32)
    mx.save_safetensors(str(directory / "model.safetensors"), {"w": mx.array(weights)})
    return directory


def test_weights_rewritten_in_place_with_size_and_mtime_kept_get_a_new_namespace(tmp_path):
    model = _model(tmp_path / "model", seed=1)
    first = _namespace(model)
    time.sleep(2.1)  # past the window in which a fresh ctime cannot vouch for a file
    assert _namespace(model) == first  # the same weights: remembered by their stamp now

    weights = model / "model.safetensors"
    before = weights.stat()
    other = _model(tmp_path / "other", seed=2)  # another checkpoint of the same shape ...
    with weights.open("r+b") as f:  # ... written over the old one's bytes, same inode
        f.write((other / "model.safetensors").read_bytes())
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)

    changed = _namespace(model)
    assert changed != first
    assert changed == _namespace(other)  # hashed again: the new contents' fingerprint
