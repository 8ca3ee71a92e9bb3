"""The embedded default model: layout, loading, geometry, determinism, behaviour."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import kvtier.engine.models.defaults as dm

pytestmark = pytest.mark.slow  # starts processes or loads the real model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dm.ensure_default_model(tmp_path_factory.mktemp("dm") / "kvtier-default")


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    return mlx_lm.load(str(model_dir))  # the real loading path, no network


def greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


def test_layout_and_config(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert set(dm.MODEL_FILES) <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == dm.EOS_TOKEN_ID
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_kv_geometry(loaded) -> None:
    model, _ = loaded
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=cache))
    assert len(cache) == 24
    assert all(c.offset == 5 for c in cache)
    keys, values = (x[..., : cache[0].offset, :] for x in cache[0].state[:2])  # buffers grow in steps
    assert keys.shape == values.shape == (1, 2, 5, 64)  # (batch, kv heads, tokens, head_dim)
    assert str(keys.dtype) == f"mlx.core.{dm.CONFIG['torch_dtype']}"
    assert 24 * (keys.nbytes + values.nbytes) // 5 == 24 * 2 * 2 * 64 * keys.dtype.size


def test_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = dm.ensure_default_model(tmp_path / "again")
    for name in dm.MODEL_FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_tokenizer_bytes_and_round_trip(loaded) -> None:
    _, tokenizer = loaded
    assert tokenizer.encode("héllo") == list("héllo".encode())  # one id per byte, no BOS
    text = "KV pages: naïve 🙂\n\ttabs  and  spaces"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("<|im_start|>") == [dm.EOS_TOKEN_ID + 1]
    assert tokenizer.eos_token_ids == {dm.EOS_TOKEN_ID}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_is_context_sensitive_and_does_not_collapse(loaded) -> None:
    model, tokenizer = loaded
    outputs = [greedy(model, tokenizer.encode(p)) for p in ("The quick brown fox", "Hello, world")]
    assert outputs[0] != outputs[1]
    for out in outputs:
        assert len(out) == 32 and dm.EOS_TOKEN_ID not in out  # runs to max_tokens
        assert len(set(out)) >= 4
        assert all(32 <= t < 127 or t == 10 for t in out)  # printable ASCII text


def test_early_block_changes_final_logits(loaded) -> None:
    model, _ = loaded
    rng = np.random.default_rng(0)
    base = rng.integers(32, 127, 600)
    changed = base.copy()
    changed[128:256] = rng.integers(32, 127, 128)  # one early 128-token block
    logits = model(mx.array(np.stack([base, changed])))[:, -1].astype(mx.float32)
    diff = np.abs(np.array(logits[0]) - np.array(logits[1])).max()
    assert diff > 1.0


def test_existing_model_is_kept(model_dir: Path) -> None:
    before = {n: (model_dir / n).stat().st_mtime_ns for n in dm.MODEL_FILES}
    assert dm.ensure_default_model(model_dir) == model_dir
    assert {n: (model_dir / n).stat().st_mtime_ns for n in dm.MODEL_FILES} == before


def test_lost_race_keeps_the_winners_copy(tmp_path: Path) -> None:
    target = tmp_path / "m"

    def write_then_lose(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"ours")
        shutil.copytree(directory, target)  # another process renames its copy in first
        (target / "theirs").write_text("")

    assert dm.ensure_default_model(target, weights=write_then_lose) == target
    assert (target / "theirs").exists()
    assert os.listdir(tmp_path) == ["m"]  # our temporary directory is gone


def test_incomplete_directory_is_not_clobbered(tmp_path: Path) -> None:
    def no_weights(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"")

    (tmp_path / "empty").mkdir()
    assert dm.is_complete(dm.ensure_default_model(tmp_path / "empty", weights=no_weights))  # empty: replaced
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="not hold a complete"):
        dm.ensure_default_model(tmp_path / "user", weights=no_weights)
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


def test_default_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    assert dm.default_model_dir() == tmp_path / "home" / "models" / f"kvtier-default-{dm.TINY_VERSION}"
    monkeypatch.delenv("KVTIER_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_model_dir().parent == tmp_path / "xdg" / "kvtier" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dm.default_model_dir().parent == tmp_path / ".cache" / "kvtier" / "models"
