"""What a model is, read from its files before anything loads: layers, heads, head dim and context from a folder's
config.json or a GGUF file's header (which is also checked for truncation: every tensor's data must lie inside the
file), and its tokenizer alone. Validation uses these to reject what would otherwise only fail after a load."""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    """What the checks before a load need from a model: decoder layers, query and KV heads, head dim, context; whether
    it carries a chat template (None: not known from its files), and whether its RoPE differs between layer types
    (Gemma 3: one base frequency on sliding-window layers, another on global ones), and which layers attend within a
    sliding window (`skip_layers=sliding_window`)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    context: int | None
    chat_template: bool | None = None
    rope_by_layer_type: bool = False
    sliding_layers: tuple[int, ...] | None = None  # layers attending within a sliding window; None: not known
    architecture: str | None = None  # config.json's model_type or the GGUF's general.architecture (llama, gemma3...)


# GGUF architectures with sliding-window layers, and the pattern llama.cpp gives them: every n-th layer is global
SLIDING_PATTERN = {"gemma3": 6, "gemma3n": 5}


def _sliding_layers(c: dict, layers: int) -> tuple[int, ...]:
    """The sliding-window layers of a config.json: its `layer_types` (transformers 5), else none."""
    types = c.get("layer_types")
    if isinstance(types, list):
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return ()


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


ROPE_BY_LAYER_TYPE = ("gemma3", "gemma3n")  # GGUF architectures whose sliding and global layers rotate differently


def _rope_by_layer_type(c: dict) -> bool:
    """A config.json whose RoPE differs between layer types: transformers 5 keys `rope_parameters` by layer type
    (`{"full_attention": {...}, "sliding_attention": {...}}`), earlier versions had `rope_local_base_freq`."""
    rp = c.get("rope_parameters")
    by_type = isinstance(rp, dict) and len(rp) > 1 and all(isinstance(v, dict) for v in rp.values())
    return by_type or c.get("rope_local_base_freq") is not None


def _folder_chat_template(p: Path) -> bool | None:
    """Whether a model folder's tokenizer files carry a chat template; None when it has no tokenizer_config.json."""
    if (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return None


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
            heads, n_layers = int(c["num_attention_heads"]), int(c["num_hidden_layers"])
            return ModelFacts(
                layers=n_layers,
                heads=heads,
                kv_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                hidden=int(c["hidden_size"]),
                context=c.get("max_position_embeddings"),
                chat_template=_folder_chat_template(p),
                rope_by_layer_type=_rope_by_layer_type(c),
                sliding_layers=_sliding_layers(c, n_layers),
                architecture=c.get("model_type"),
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
            chat_template="tokenizer.chat_template" in meta,
            rope_by_layer_type=arch in ROPE_BY_LAYER_TYPE,
            sliding_layers=_gguf_sliding(arch, get("attention.sliding_window"), layers),
            architecture=arch,
        )
    return None


def _gguf_sliding(arch: str, window, layers: int) -> tuple[int, ...] | None:
    """A GGUF's sliding-window layers: llama.cpp's pattern for its architecture (every n-th layer global); none
    without a window; None (not known) for a window on an architecture whose pattern is not listed here."""
    if not window:
        return ()
    n = SLIDING_PATTERN.get(arch)
    return None if n is None else tuple(i for i in range(layers) if (i + 1) % n)


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer(src: str):
    """The tokenizer of a resolved local model (folder or GGUF), without its weights; kept per process."""
    if src not in _TOKENIZERS:
        from transformers import AutoTokenizer

        p = Path(src)
        gguf = {"gguf_file": p.name} if p.is_file() else {}
        _TOKENIZERS[src] = AutoTokenizer.from_pretrained(p.parent if p.is_file() else p, **gguf)
    return _TOKENIZERS[src]
