"""What a run's numbers are computed from, as content hashes: the code, the model, the libraries.

Together with the resolved config and the task's data identity (`Task.inputs`) these make the run key: resume
reuses a record only when every part matches, so a changed quantizer, data file or model reruns instead of
reporting a stale score. Large files are hashed once per (path, size, mtime) and remembered in
`~/.cache/kvq_lab/hashes.json` ($KVQ_HASH_CACHE, with its digest beside it, verified on read), so a sweep pays for
the model hash once.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from kvq_lab.common import integrity

PACKAGE = Path(__file__).resolve().parents[1]  # kvq_lab/, the whole package
CODE_SUFFIXES = (".py", ".c", ".yaml")
LIBRARIES = ("torch", "transformers", "lm_eval", "datasets")  # their arithmetic and tokenizers reach the numbers


def code_version(root: Path = PACKAGE) -> str:
    """sha256 (16 hex) over the package's sources (.py, .c, .yaml: path and bytes), independent of git state."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in CODE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _hash_cache_path() -> Path:
    return Path(os.environ.get("KVQ_HASH_CACHE", Path.home() / ".cache" / "kvq_lab" / "hashes.json"))


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, remembered per (path, size, mtime) across processes."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    store = _hash_cache_path()
    known = {}
    if store.is_file():
        try:
            known = json.loads(integrity.read_verified(store))
        except integrity.Corrupt as e:  # a changed memo would give a model a wrong identity: start it again
            integrity.note_rebuild(e, "hashing the files again")
        except ValueError:
            pass
    if key in known:
        return known[key]
    digest = integrity.sha256_file(path)
    known[key] = digest
    try:  # best effort: a read-only home only costs a rehash next time
        integrity.write_verified(store, json.dumps(known).encode())
    except OSError:
        pass
    return digest


def model_identity(name_or_path: str, revision: str | None = None) -> dict[str, Any]:
    """What the model is, without loading it: the embedded GGUF's hash, a local folder's or file's content hash,
    or a hub id with its revision (`main` when none is pinned)."""
    from kvq_lab.models.loading import EMBEDDED, embedded_gguf

    if name_or_path in EMBEDDED:  # the shipped GGUF, before or after its one-time conversion
        gguf = embedded_gguf(name_or_path)
        if gguf is not None:
            return {"source": "embedded", "name": name_or_path, "sha256": file_sha256(gguf)}
        return {"source": "hub", "id": EMBEDDED[name_or_path].hub_id, "revision": revision or "main"}
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return {"source": "file", "path": str(p.resolve()), "sha256": file_sha256(p)}
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith(".")):
            h.update(f.name.encode() + b"\0" + file_sha256(f).encode())
        return {"source": "folder", "path": str(p.resolve()), "sha256": h.hexdigest()}
    return {"source": "hub", "id": name_or_path, "revision": revision or "main"}


def library_versions() -> dict[str, str | None]:
    out = {}
    for pkg in LIBRARIES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def run_key(config_hash: str, inputs: dict[str, Any]) -> str:
    """The resume key: the config hash and every input identity, hashed together (16 hex)."""
    blob = json.dumps({"config": config_hash, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
