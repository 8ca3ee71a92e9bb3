"""Where imported models are written: each directory's marker, the index of imports
by their source's digest, the lock two importers of one directory share, and the swap
that puts a finished directory in place (DESIGN §8: ``kvtier import-gguf``).

The marker (``kvtier-import.json``) names what a directory holds (importer version,
dtype, the source's digest); the index (``<kvtier home>/models/imports.json``) maps
that to the directory, so the same content under another file name is found without
a second copy. An index entry is trusted only while its directory's marker matches;
an index kvtier cannot write only costs copies, so it is logged, never an error.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .paths import kvtier_home

log = logging.getLogger(__name__)

MARKER = "kvtier-import.json"
IMPORTS_INDEX = "imports.json"  # under <kvtier home>/models: {digest-dtype-version: directory}


class ImportDirError(Exception):
    """The place an import is written cannot be (one line naming it)."""


def register_import(directory: Path) -> None:
    """List the import in ``directory`` by its source's digest (read from its marker, so
    an import made before the index existed registers without hashing its source
    again). An index kvtier cannot write is logged, not an error: it only saves copies."""
    marker = read_marker(directory)
    if marker is None:
        return
    index, listed = read_index(), str(Path(directory).resolve())
    if index.get(_index_key(marker)) == listed:
        return  # the default model's every start comes here: no write
    index[_index_key(marker)] = listed
    index = {key: path for key, path in index.items() if read_marker(Path(path)) is not None}  # drop removed ones
    path = _index_path()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(tmp, index)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("cannot update %s: %s", path, err.strerror or err)
        tmp.unlink(missing_ok=True)


def imported_as(marker: dict) -> Path | None:
    """The directory the index lists for this source digest, dtype and importer version,
    if it still holds that import."""
    listed = read_index().get(_index_key(marker))
    return Path(listed) if listed is not None and read_marker(Path(listed)) == marker else None


def _index_key(marker: dict) -> str:
    return f"{marker.get('source_blake2b')}-{marker.get('dtype')}-v{marker.get('importer_version')}"


def _index_path() -> Path:
    return kvtier_home() / "models" / IMPORTS_INDEX


def read_index() -> dict[str, str]:
    try:
        index = json.loads(_index_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in index.items() if isinstance(v, str)} if isinstance(index, dict) else {}


def default_import_dir(source: Path, dtype: str) -> Path:
    return kvtier_home() / "models" / f"{Path(source).stem}-{dtype}"


@contextmanager
def import_lock(directory: Path) -> Iterator[None]:
    """Hold the lock of imports into ``directory`` (a file under the kvtier home, named
    by the directory's path, so nothing is left beside it; released when the process
    ends, however it ends). Two processes importing at once, such as two first runs of
    one kvtier home, would each convert the file and swap their copy in while the
    other's was being loaded."""
    name = hashlib.blake2b(str(directory.resolve()).encode(), digest_size=8).hexdigest()
    lock = kvtier_home() / "locks" / f"import-{name}.lock"
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ImportDirError(f"cannot write {lock.parent}: {err.strerror or err}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def replacing(directory: Path) -> Iterator[Path]:
    """Build in a temporary sibling, then swap it in for ``directory``: readers see the
    old import or the new one, never half of one."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp, old = (directory.with_name(f".{directory.name}.{kind}-{tag}") for kind in ("tmp", "old"))
    try:
        tmp.mkdir()
        yield tmp
        if directory.exists():
            os.rename(directory, old)
        os.rename(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
