"""Content digests for everything kvq_lab writes once and reads back: the caches under ~/.cache/kvq_lab (calibration
fits, compiled kernels, converted models, sensitivities) and the run records.

A cache file is written atomically next to a sidecar `<name>.sha256` ("<hex>  <name>", as `sha256sum` writes it);
`read_verified` returns its bytes only when they hash to the sidecar's digest, else raises `Corrupt` naming the file
and what is wrong with it (missing sidecar, truncated, changed). A folder (a converted model) gets one manifest,
`kvq_manifest.sha256`, with a line per file. Callers report a `Corrupt` in one line (`note_rebuild`) and rebuild the
entry; nothing kvq_lab caches is ever trusted because it merely exists.

The data file and its sidecar are two renames, so a reader can see a new file with an old digest for an instant: it
then rebuilds the entry, which is correct, only slower. The digest guards against truncation, bit rot and hand
edits, not against someone who recomputes it on purpose.

Records (`seal` / `unsealed_reason`): `record.json` carries `digest`, a sha256 over its own canonical JSON (the body
without `digest`) and over every file it names beside it (samples, Parquet tables), so an edited metric, an edited
sample or a swapped table no longer passes for what a run produced.

Standard library only: the records layer, the kernels' loader and validation all use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

SIDECAR = ".sha256"
MANIFEST = "kvq_manifest.sha256"
CHUNK = 1 << 22


class Corrupt(Exception):
    """A cached file or a record does not match its digest; `path` names it, `reason` says how."""

    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sidecar(path: Path | str) -> Path:
    p = Path(path)
    return p.with_name(p.name + SIDECAR)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_verified(path: Path | str, data: bytes) -> str:
    """Write `data` to `path` and its digest to the sidecar, each atomically; -> the digest."""
    path = Path(path)
    digest = sha256_bytes(data)
    _atomic_write(path, data)
    _atomic_write(sidecar(path), f"{digest}  {path.name}\n".encode())
    return digest


def seal_file(path: Path | str) -> str:
    """Write the sidecar of a file that is already in place (e.g. a compiled library); -> the digest."""
    path = Path(path)
    digest = sha256_file(path)
    _atomic_write(sidecar(path), f"{digest}  {path.name}\n".encode())
    return digest


def _expected(path: Path) -> str:
    try:
        text = sidecar(path).read_text()
    except FileNotFoundError:
        raise Corrupt(path, f"has no digest beside it ({sidecar(path).name}): written by an older kvq_lab or cut "
                            "short while being written") from None  # fmt: skip
    except OSError as e:
        raise Corrupt(path, f"its digest cannot be read ({e})") from None
    digest = text.split()[0] if text.split() else ""
    if len(digest) != 64:
        raise Corrupt(path, f"its digest file {sidecar(path).name} is malformed")
    return digest


def verify_file(path: Path | str) -> str:
    """Raise `Corrupt` unless the file hashes to its sidecar's digest; -> the digest."""
    path = Path(path)
    expected = _expected(path)
    try:
        actual = sha256_file(path)
    except OSError as e:
        raise Corrupt(path, f"cannot be read ({e})") from None
    if actual != expected:
        raise Corrupt(path, f"does not match its digest (truncated or changed: {os.path.getsize(path)} bytes)")
    return actual


def read_verified(path: Path | str) -> bytes:
    """The file's bytes, verified against its sidecar (`Corrupt` otherwise)."""
    path = Path(path)
    expected = _expected(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Corrupt(path, f"cannot be read ({e})") from None
    if sha256_bytes(data) != expected:
        raise Corrupt(path, f"does not match its digest (truncated or changed: {len(data)} bytes)")
    return data


def remove(path: Path | str) -> None:
    """Delete a cache entry and its sidecar (best effort: a read-only cache is rebuilt elsewhere or in memory)."""
    for p in (Path(path), sidecar(path)):
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass


def note_rebuild(e: Corrupt, what: str = "rebuilding it") -> None:
    """The one line a caller prints before rebuilding a corrupt cache entry."""
    print(f"note: {e.path} {e.reason}; {what}", file=sys.stderr, flush=True)


# -- folders (a converted model) --------------------------------------------------------------------------------------
def seal_folder(folder: Path | str) -> None:
    """Write `kvq_manifest.sha256` listing every file of the folder (not hidden ones) with its digest."""
    folder = Path(folder)
    lines = [f"{sha256_file(p)}  {p.name}\n" for p in sorted(folder.iterdir()) if _listed(p)]
    _atomic_write(folder / MANIFEST, "".join(lines).encode())


def _listed(p: Path) -> bool:
    return p.is_file() and p.name != MANIFEST and not p.name.startswith(".")


def verify_folder(folder: Path | str) -> None:
    """Raise `Corrupt` (naming the first bad file) unless every file of the manifest is there with its digest and
    nothing else is."""
    folder = Path(folder)
    try:
        lines = (folder / MANIFEST).read_text().splitlines()
    except FileNotFoundError:
        raise Corrupt(folder, f"has no {MANIFEST}: written by an older kvq_lab or cut short") from None
    listed = {}
    for line in lines:
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not name:
            raise Corrupt(folder / MANIFEST, "is malformed")
        listed[name] = digest
    present = {p.name for p in folder.iterdir() if _listed(p)}
    for name in sorted(present - set(listed)):
        raise Corrupt(folder / name, f"is not in {MANIFEST}")
    for name, digest in listed.items():
        p = folder / name
        if not p.is_file():
            raise Corrupt(p, "is missing")
        if sha256_file(p) != digest:
            raise Corrupt(p, f"does not match its digest in {MANIFEST} (truncated or changed)")


# -- records ---------------------------------------------------------------------------------------------------------
def canonical(obj: Any) -> bytes:
    """The JSON a digest is computed over: sorted keys, no whitespace (NaN and infinities as Python writes them)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def record_files(body: dict) -> list[str]:
    """The files beside a record that its numbers live in: samples.json and every sidecar table it names."""
    names = []
    if body.get("samples_file"):
        names.append(body["samples_file"])

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("file"), str) and "n_rows" in x:
                names.append(x["file"])
            for v in x.values():
                walk(v)

    walk(body.get("artifacts") or {})
    return names


def record_digest(body: dict, folder: Path | str) -> dict[str, Any]:
    """{"sha256": over the body (without `digest`) and each named file's digest, "files": {name: sha256}}."""
    body = {k: v for k, v in body.items() if k != "digest" and not k.startswith("_")}  # `_path`: where it was read
    files = {name: sha256_file(Path(folder) / name) for name in record_files(body)}
    h = hashlib.sha256(canonical(body))
    for name in sorted(files):
        h.update(f"\0{name}\0{files[name]}".encode())
    return {"sha256": h.hexdigest(), "files": files}


def seal(body: dict, folder: Path | str) -> dict:
    """`body` with its `digest` (the files it names must already be written in `folder`)."""
    body = {k: v for k, v in body.items() if k != "digest" and not k.startswith("_")}
    return {**body, "digest": record_digest(body, folder)}


def unsealed_reason(rec: dict, folder: Path | str | None = None) -> str | None:
    """None when the record matches its digest; else why not ("no digest" for records made before sealing)."""
    folder = Path(folder if folder is not None else rec["_path"])
    d = rec.get("digest")
    if not isinstance(d, dict) or "sha256" not in d:
        return "no digest"
    try:
        now = record_digest(rec, folder)
    except OSError as e:
        return f"a file it names cannot be read ({e.filename or e})"
    if now["sha256"] == d["sha256"]:
        return None
    changed = [n for n, h in now["files"].items() if d.get("files", {}).get(n) != h]
    if changed:
        return f"{changed[0]} does not match the record's digest (edited or corrupt)"
    return "its contents do not match its digest (edited or corrupt)"
