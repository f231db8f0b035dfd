"""Where the text of `task=ppl` and `task=fidelity` comes from: `task.source`, checked and identified before any
model loads (plain Python; `datasets` only for the hub source).

- `coqa_stories`: the CoQA validation stories in file order (local file under the data dir, else the hub's
  `EleutherAI/coqa`), joined by blank lines.
- `gsm8k`: GSM8K's `task.split` (test, default, or train) as "Question: ...\nAnswer: ..." blocks in file order joined
  by blank lines (local file under the data dir, else the hub's `gsm8k`): ~150K tokens in test, the long source
  (the CoQA stories hold ~7K); the calibration text is the first 600 train blocks of the same form.
- `file`: any UTF-8 text file, `task.path=<file>` (read as is; a BOM is dropped).
- `hf`: a hub dataset through `datasets.load_dataset(task.dataset, task.dataset_config, split=task.split)`, the
  rows' `task.text_field` joined by blank lines, as the Hugging Face perplexity guide joins wikitext
  (`task.dataset=wikitext task.dataset_config=wikitext-2-raw-v1 task.split=test`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvq_lab.tasks import DataFile, read_data_file
from kvq_lab.tasks.datasets import COQA_DATA, COQA_HUB, GSM8K_CONFIG, GSM8K_DATA, GSM8K_FILES, GSM8K_HUB

SOURCES = ("coqa_stories", "gsm8k", "file", "hf")
OPTIONS = ("source", "path", "dataset", "dataset_config", "split", "text_field")  # the task.* keys read here

_FILES: dict[tuple, tuple[str, str]] = {}  # (path, size, mtime) -> (text, sha256)
_HUB: dict[tuple, str] = {}  # (dataset, config, split, field) -> text


def _str_option(t, key: str, example: str) -> str:
    v = t.get(key)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"task.source={t.get('source')} needs task.{key}=<{example}> (got {v!r})")
    return v


def read_text_file(path: str | Path) -> tuple[str, str]:
    """-> (text, sha256 of the bytes). ValueError naming the path for a missing, non-file or non-UTF-8 input."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"task.path={str(path)!r} does not exist; give a UTF-8 text file")
    if not p.is_file():
        raise ValueError(f"task.path={str(path)!r} is not a file; give a UTF-8 text file")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _FILES:
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"task.path={str(path)!r} is not UTF-8 text (byte {e.start}); convert it, e.g. iconv -t UTF-8"
            ) from None
        _FILES[key] = (text, hashlib.sha256(raw).hexdigest())
    return _FILES[key]


def load_hub_rows(dataset: str, config: str | None, split: str) -> Any:
    """The hub split as `datasets` returns it (a seam for tests without network)."""
    import datasets

    return datasets.load_dataset(dataset, config, split=split)


def hub_text(dataset: str, config: str | None, split: str, field: str) -> str:
    key = (dataset, config, split, field)
    if key not in _HUB:
        rows = load_hub_rows(dataset, config, split)
        if field not in rows.column_names:
            raise ValueError(
                f"task.text_field={field!r} is not a column of {dataset}/{config}:{split}; its columns: "
                f"{', '.join(rows.column_names)}"
            )
        _HUB[key] = "\n\n".join(str(x) for x in rows[field])
    return _HUB[key]


def coqa_text(data_dir: Path | None) -> str:
    data_dir = data_dir or (Path(os.environ["KVQ_DATA_DIR"]) if os.environ.get("KVQ_DATA_DIR") else None)
    if data_dir is not None:
        stories = [r["story"] for r in read_data_file(Path(data_dir), COQA_DATA)[0]]
    else:
        import datasets

        stories = list(dict.fromkeys(datasets.load_dataset(COQA_HUB, split="validation")["story"]))
    return "\n\n".join(s.strip() for s in stories)


def gsm8k_text(data_dir: Path | None, split: str, n: int | None = None) -> str:
    """The first n (None: all) rows of GSM8K's `split` as "Question: q\nAnswer: a" blocks joined by blank lines."""
    if data_dir is not None:  # parsed and checked once per file (read_data_file), as validation read it
        rows = read_data_file(Path(data_dir), gsm8k_file(split))[0][:n]
    else:
        import datasets

        rows = list(datasets.load_dataset(GSM8K_HUB, GSM8K_CONFIG, split=split if n is None else f"{split}[:{n}]"))
    return "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows)


def gsm8k_file(split: str) -> DataFile:
    """The data-folder file of GSM8K's `split` (test or train)."""
    return next(f for f in GSM8K_DATA if f.rel == GSM8K_FILES[split])


def source_files(t) -> tuple[DataFile, ...]:
    """The data-folder files the source reads (checked and hashed before any model loads)."""
    if t.get("source") == "coqa_stories":
        return (COQA_DATA,)
    if t.get("source") == "gsm8k":
        return (gsm8k_file(t.split),)
    return ()


def check_source(t) -> None:
    """Options of the source (and, for `file`, the file itself): ValueError with the fix. No download."""
    source = t.get("source")
    if source not in SOURCES:
        raise ValueError(f"task.source={source!r}; choose one of: {', '.join(SOURCES)}")
    if source == "file":
        read_text_file(_str_option(t, "path", "UTF-8 text file"))
    elif source == "gsm8k":
        if t.get("split") not in GSM8K_FILES:
            raise ValueError(f"task.source=gsm8k reads task.split={t.get('split')!r}; choose one of: test, train")
    elif source == "hf":
        _str_option(t, "dataset", "hub dataset id, e.g. wikitext")
        _str_option(t, "split", "split, e.g. test")
        _str_option(t, "text_field", "text column, e.g. text")
        if t.get("dataset_config") is not None and not isinstance(t.get("dataset_config"), str):
            raise ValueError(f"task.dataset_config={t.get('dataset_config')!r} must be a config name or null")


def source_text(t, data_dir: Path | None) -> str:
    """The text windows are cut from (see the module docstring)."""
    check_source(t)
    if t.source == "file":
        return read_text_file(t.path)[0]
    if t.source == "hf":
        return hub_text(str(t.dataset), t.get("dataset_config"), str(t.split), str(t.text_field))
    if t.source == "gsm8k":
        return gsm8k_text(data_dir, str(t.split))
    return coqa_text(data_dir)


def source_inputs(t, data_dir: Path | None) -> dict[str, Any]:
    """What the numbers are computed from: the file's content hash, the hub dataset, or the data files' hashes."""
    if t.source == "file":
        return {"source": "file", "path": str(Path(t.path).expanduser().resolve()), "sha256": read_text_file(t.path)[1]}
    if t.source == "hf":
        cfg = f"/{t.dataset_config}" if t.get("dataset_config") else ""
        return {"source": "hub", "datasets": [f"{t.dataset}{cfg}:{t.split}"], "field": t.text_field, "revision": None}
    if data_dir is not None:  # the data folder's files, by the sha256 of their bytes
        return {"source": "local", "files": {f.rel: read_data_file(Path(data_dir), f)[1] for f in source_files(t)}}
    hub = f"{GSM8K_HUB}/{GSM8K_CONFIG}:{t.split}" if t.source == "gsm8k" else COQA_HUB
    return {"source": "hub", "datasets": [hub], "revision": None}
