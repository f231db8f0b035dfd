"""The 16-bit reference kept on disk (kvq_lab/tasks/reference.py): computed once, reused across processes, never for
another model, text or protocol, rebuilt when its file is damaged, and kept under its size budget."""

from __future__ import annotations

import copy

import pytest
import torch

from kvq_lab.tasks import reference
from kvq_lab.tasks.reference import cache_dir, reference_key, stored_reference


@pytest.fixture
def store(monkeypatch, tmp_path):
    monkeypatch.setenv("KVQ_REFERENCE_CACHE", str(tmp_path / "ref"))
    reference._MEMO.clear()
    yield tmp_path / "ref"
    reference._MEMO.clear()


def _compute(calls: list, value: float = 1.0):
    def compute():
        calls.append(1)
        return torch.full((2, 3, 5), value) + torch.arange(5.0)

    return compute


def test_computed_once_then_read_from_disk_bit_for_bit(store, tiny_model):
    ids = torch.arange(12).reshape(2, 6)
    calls = []
    first = stored_reference(tiny_model, ids, {"protocol": "chunks"}, _compute(calls))
    assert stored_reference(tiny_model, ids, {"protocol": "chunks"}, _compute(calls)) is first  # the process's memo
    reference._MEMO.clear()  # another process: only the disk is shared
    again = stored_reference(tiny_model, ids, {"protocol": "chunks"}, _compute(calls))
    assert calls == [1] and torch.equal(again, first) and again.dtype == torch.float32
    assert [p.suffix for p in sorted(store.iterdir())] == [".pt", ".sha256"] and cache_dir() == store


def test_another_model_text_or_protocol_is_another_reference(store, tiny_model):
    ids = torch.arange(12).reshape(2, 6)
    key = reference_key(tiny_model, ids, {"protocol": "chunks"})
    assert reference_key(tiny_model, ids, {"protocol": "chunks"}) == key
    assert reference_key(tiny_model, ids + 1, {"protocol": "chunks"}) != key  # another text
    assert reference_key(tiny_model, ids.reshape(3, 4), {"protocol": "chunks"}) != key  # the same ids, cut otherwise
    assert reference_key(tiny_model, ids, {"protocol": "decode", "context": 4}) != key
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1e-3  # one weight changed: the same name, another model
    assert reference_key(other, ids, {"protocol": "chunks"}) != key


def test_a_damaged_file_is_named_and_computed_again(store, tiny_model, capsys):
    ids = torch.arange(6)[None]
    calls = []
    stored_reference(tiny_model, ids, {"protocol": "chunks"}, _compute(calls))
    (pt,) = store.glob("*.pt")
    pt.write_bytes(pt.read_bytes()[:-10])  # truncated
    reference._MEMO.clear()
    got = stored_reference(tiny_model, ids, {"protocol": "chunks"}, _compute(calls, 2.0))
    assert calls == [1, 1] and float(got[0, 0, 0]) == 2.0
    assert "does not match its digest" in capsys.readouterr().err


def test_the_folder_stays_under_its_budget_least_recently_used_first(store, tiny_model, monkeypatch):
    calls, keys = [], []
    for i in range(3):
        ids = torch.arange(6)[None] + i
        stored_reference(tiny_model, ids, {"protocol": "chunks"}, _compute(calls))
        keys.append(reference_key(tiny_model, ids, {"protocol": "chunks"}))
        if i == 0:  # room for two files of this size
            size = next(store.glob("*.pt")).stat().st_size
            monkeypatch.setenv("KVQ_REFERENCE_CACHE_GB", str(2.5 * size / 2**30))
    assert {p.stem for p in store.glob("*.pt")} == set(keys[1:])
    assert {p.name for p in store.glob("*.sha256")} == {f"{k}.pt.sha256" for k in keys[1:]}
