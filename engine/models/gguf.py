"""Import a GGUF file (llama.cpp, Ollama, LM Studio) as an mlx-lm model directory.

The output is what ``mlx_lm.load`` reads as it is: ``config.json``, safetensors written
by ``mlx_lm.utils.save_model``, and ``tokenizer.json`` + ``tokenizer_config.json``
rebuilt from the GGUF's own vocabulary, merges, special tokens and chat template.

``mx.load`` reads the GGUF: F32/F16/BF16 tensors as they are, Q4_0/Q4_1/Q8_0 as mlx
affine groups of 32 (``weight``/``scales``/``biases``), the K-quants dequantized to
float16; a type it cannot read (the IQ quantizations) is refused. ``dtype`` either
dequantizes everything to one float type or keeps the quantized matrices (``keep``),
with the config naming the bits of each layer.

Rotary layout: llama.cpp's converter permutes the q/k rows of ``llama`` models so
that each rotated pair is adjacent (GGML's "normal" rope), which is mlx's
``traditional`` rope; ``qwen2`` keeps Hugging Face's half-split ("neox") rows. The
config says which (``rope_traditional``); with the wrong one the model still runs
but its text is poor (the real-model tests check the perplexity of both).

Importing is deterministic (same file and dtype, same bytes) and the directory is
written once: a ``kvtier-import.json`` beside the model names the source's digest,
and a later import of the same file into the same directory does nothing. Every
import is also listed by that digest in ``<kvtier home>/models/imports.json``, so the
same content under another file name (a copy, an Ollama blob, the GGUF the default
model came from) is not written a second time when no ``out`` is named: the listed
directory is returned. An entry is trusted only while its directory's marker still
matches; a lost entry (two processes writing the index at once) only costs a copy.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .imported import (
    MARKER,
    ImportDirError,
    default_import_dir,
    import_lock,
    imported_as,
    read_marker,
    register_import,
    replacing,
    write_json,
)

log = logging.getLogger(__name__)

# Bump when the output for a given file changes, so stale imports are redone.
IMPORTER_VERSION = 1
DTYPES = ("float32", "float16", "bfloat16", "keep")
_GGUF_MAGIC = b"GGUF"
_GROUP_SIZE = 32  # every GGUF block type mx.load understands has 32 weights per block


class GGUFError(Exception):
    """The file cannot be imported (one line naming what is unsupported)."""


@dataclass(frozen=True)
class Architecture:
    model_type: str
    rope_traditional: bool  # True: GGML "normal" rope, pairs adjacent (llama.cpp permuted q/k)
    has_qkv_bias: bool


ARCHITECTURES = {
    "llama": Architecture("llama", rope_traditional=True, has_qkv_bias=False),
    "qwen2": Architecture("qwen2", rope_traditional=False, has_qkv_bias=True),
}

# GGUF tensor names -> Hugging Face / mlx-lm module paths.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PARAMS = ("weight", "bias", "scales", "biases")

# Pre-tokenizer regexes, as llama.cpp names them (``tokenizer.ggml.pre``); None: GPT-2's
# own, built into the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {  # name -> (split regex, digits one by one)
    "default": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "qwen2": (_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"), False),
}


def import_gguf(
    source: Path, out: Path | None = None, dtype: str = "float32", progress: Callable[[int, int], None] | None = None
) -> Path:
    """Write (once) the mlx-lm model directory of ``source`` and return it.

    ``out`` defaults to an earlier import of the same content and dtype (whatever the
    file was called), else ``<kvtier home>/models/<file stem>-<dtype>``. ``progress``
    is called with (bytes converted so far, bytes in all) after each tensor.
    Raises :class:`GGUFError` for a file that is not a readable, supported GGUF.
    """
    if dtype not in DTYPES:
        raise GGUFError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    source = Path(source)
    marker = {"importer_version": IMPORTER_VERSION, "dtype": dtype, "source_blake2b": _digest(source)}
    if out is None and (known := imported_as(marker)) is not None:
        log.info("%s is already imported as %s", source.name, known)
        return known
    out = Path(out) if out is not None else default_import_dir(source, dtype)
    if _holds(out, marker, source):
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise GGUFError(f"{out} exists and is not a kvtier import; choose another --out")
    tensors, metadata = _read(source)  # a file kvtier cannot import fails here, having written nothing
    arch = _architecture(metadata)
    config = _config(arch, metadata, tensors)
    tokenizer, tokenizer_config = _tokenizer(metadata)
    try:
        with import_lock(out):  # a second importer waits, then finds the first one's import
            if _holds(out, marker, source):
                return out
            weights = _weights(tensors, dtype, config, progress)
            log.info("importing %s (%s) into %s as %s", source.name, arch.model_type, out, dtype)
            try:
                with replacing(out) as tmp:
                    _save_model(tmp, config, weights)
                    tokenizer.save(str(tmp / "tokenizer.json"))
                    write_json(tmp / "tokenizer_config.json", tokenizer_config)
                    write_json(tmp / MARKER, marker)
            except OSError as err:
                raise GGUFError(f"cannot write {out}: {err.strerror or err}") from None
    except ImportDirError as err:
        raise GGUFError(str(err)) from None
    register_import(out)
    return out


def _holds(out: Path, marker: dict, source: Path) -> bool:
    """Whether ``out`` already holds this import (then it is listed in the index)."""
    if read_marker(out) != marker:
        return False
    log.info("%s already holds %s", out, source.name)
    register_import(out)
    return True


def is_imported(directory: Path, dtype: str) -> bool:
    """Whether ``directory`` holds a complete import by this importer version in ``dtype``
    (whatever the source; :func:`import_gguf` also compares the source's digest)."""
    marker = read_marker(directory) or {}
    return marker.get("importer_version") == IMPORTER_VERSION and marker.get("dtype") == dtype


def _read(source: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    try:
        with source.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise GGUFError(f"cannot read {source}: {err.strerror}") from None
    if magic != _GGUF_MAGIC:
        raise GGUFError(f"{source} is not a GGUF file")
    try:
        # by its magic, not its name: Ollama keeps GGUFs as blobs named sha256-<digest>
        loaded = mx.load(str(source), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, KeyError) as err:  # mlx: truncated file, unknown tensor type, ...
        reason = _one_line(err)
        if "to_f16" in reason or isinstance(err, KeyError):
            reason = f"it holds a tensor type mlx cannot read ({reason})"
        raise GGUFError(f"cannot load {source.name}: {reason}") from None
    # mlx's stub gives every kind load returns; with return_metadata it is (tensors, metadata)
    return cast(tuple[dict[str, Any], dict[str, Any]], loaded)


def _architecture(metadata: dict[str, Any]) -> Architecture:
    name = metadata.get("general.architecture")
    if name not in ARCHITECTURES:
        raise GGUFError(f"unsupported architecture {name!r} (supported: {', '.join(ARCHITECTURES)})")
    if f"{name}.expert_count" in metadata:
        raise GGUFError(f"unsupported: mixture-of-experts {name} models")
    return ARCHITECTURES[name]


def _config(arch: Architecture, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """config.json for mlx-lm's model class of this architecture."""
    if "rope_freqs.weight" in tensors:
        raise GGUFError("unsupported: rope_freqs tensor (Llama 3.1-style rope scaling)")
    prefix = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{prefix}.{key}", default)
        if value is None:
            raise GGUFError(f"missing metadata {prefix}.{key}")
        return value.item() if hasattr(value, "item") else value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError("unsupported: partial rotary embedding")
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "rms_norm_eps": _float32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(get("rope.freq_base", 10000.0)),
        "rope_traditional": arch.rope_traditional,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": _eos_ids(meta),
    }
    if arch.model_type == "llama":
        config["head_dim"] = head_dim
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    scaling = meta.get(f"{prefix}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"unsupported rope scaling {scaling!r}")
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    return config


def _float32(value: float) -> float:
    """A GGUF float32 as the decimal it was written from (1e-05, not 9.99999974e-06)."""
    return float(f"{value:.7g}")


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    """End-of-sequence, end-of-turn and end-of-message ids: each one stops generation."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [int(meta[f"tokenizer.ggml.{k}"].item()) for k in keys if f"tokenizer.ggml.{k}" in meta]
    if not ids:
        raise GGUFError("missing metadata tokenizer.ggml.eos_token_id")
    return sorted(set(ids))


def _hf_name(gguf_name: str) -> str:
    module, _, param = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", module)
    if match and match.group(2) in _BLOCK_NAMES and param in _PARAMS:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{param}"
    if module in _GLOBAL_NAMES and param in _PARAMS:
        return f"{_GLOBAL_NAMES[module]}.{param}"
    raise GGUFError(f"unsupported tensor {gguf_name!r}")


def _weights(
    tensors: dict[str, Any], dtype: str, config: dict[str, Any], progress: Callable[[int, int], None] | None
) -> dict[str, Any]:
    """Renamed tensors, dequantized to ``dtype`` or kept (then ``config`` gets the bits)."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    bits_of: dict[str, int] = {}
    float_type = _float_type(dtype, tensors)
    total, done = sum(t.nbytes for t in tensors.values()), 0
    for name in sorted(tensors):
        if name.endswith((".scales", ".biases")):
            continue
        module = name.rpartition(".")[0]
        w = tensors[name]
        done += w.nbytes
        if f"{module}.scales" in tensors:
            scales, biases = tensors[f"{module}.scales"], tensors[f"{module}.biases"]
            done += scales.nbytes + biases.nbytes
            bits = w.shape[-1] * 32 // (scales.shape[-1] * _GROUP_SIZE)
            if dtype == "keep":
                path = _hf_name(name).rpartition(".")[0]
                bits_of[path] = bits
                weights[f"{path}.scales"], weights[f"{path}.biases"] = scales, biases
            else:
                w = mx.dequantize(w, scales, biases, group_size=_GROUP_SIZE, bits=bits)
        if dtype != "keep" or w.dtype != mx.uint32:
            w = w.astype(float_type)
        weights[_hf_name(name)] = w
        mx.eval(w)
        if progress:
            progress(done, total)
    if bits_of:
        common = max(sorted(set(bits_of.values())), key=list(bits_of.values()).count)
        quantization: dict[str, Any] = {"group_size": _GROUP_SIZE, "bits": common, "mode": "affine"}
        quantization.update(
            {
                path: {"group_size": _GROUP_SIZE, "bits": b, "mode": "affine"}
                for path, b in sorted(bits_of.items())
                if b != common
            }
        )
        config["quantization"] = quantization
    return weights


def _float_type(dtype: str, tensors: dict[str, Any]):
    """The float type of the output: ``dtype``, or for ``keep`` that of the scales."""
    import mlx.core as mx

    if dtype != "keep":
        return getattr(mx, dtype)
    scales = [t.dtype for n, t in sorted(tensors.items()) if n.endswith(".scales")]
    return scales[0] if scales else mx.float32


def _save_model(directory: Path, config: dict[str, Any], weights: dict[str, Any]) -> None:
    """Load the weights into mlx-lm's model class (strict: every tensor must fit) and
    save it with mlx-lm's own writer."""
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes, save_config, save_model

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(
            model,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: q.get(p, True) if f"{p}.scales" in weights else False,
        )
    try:
        model.load_weights(sorted(weights.items()), strict=True)
    except ValueError as err:
        raise GGUFError(f"tensors do not fit a {config['model_type']} model: {_one_line(err)}") from None
    save_model(directory, model)
    save_config(dict(config), directory / "config.json")


def _tokenizer(meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The contents of tokenizer.json (a ``tokenizers.Tokenizer``) and
    tokenizer_config.json, from the GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"unsupported tokenizer model {kind!r} (supported: byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"unsupported pre-tokenizer {pre!r} (supported: {', '.join(_PRE_TOKENIZERS)})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    split, single_digits = _PRE_TOKENIZERS[pre]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=split == _LLAMA3_SPLIT)
    )
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if single_digits else []
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    if pre == "qwen2":  # as Qwen2's own tokenizer.json
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"].tolist()  # 3: control, 4: user-defined
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == 3]
    )
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == 4])

    def token(key: str) -> str | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if value is None else tokens[int(value.item())]

    add_bos = bool(meta["tokenizer.ggml.add_bos_token"].item()) if "tokenizer.ggml.add_bos_token" in meta else False
    bos = token("bos") if add_bos else None
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokens.index(bos))]
        )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 0)) or None,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok, config


def _digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    except OSError as err:
        raise GGUFError(f"cannot read {path}: {err.strerror}") from None
    return digest.hexdigest()


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
