"""Primitive timings kept in exitlm's cache between processes (exitlm.runtime.cost_store)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from _ee_models import ee_model
from exitlm.infer import generate
from exitlm.io import cache as cache_mod
from exitlm.runtime import cost_store, prepare
from exitlm.runtime.costs import PrimitiveCosts, _kind


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache with the store on (the suite turns it off: conftest.py)."""
    monkeypatch.setenv("EXITLM_CACHE", str(tmp_path))
    monkeypatch.setenv("EXITLM_COST_CACHE", "1")
    return tmp_path / cost_store.FOLDER


def _measure(costs: PrimitiveCosts) -> list[float]:
    return [costs.chain(4, 0), costs.chain(2, 3), costs.layers(2, 3), costs.head(4, 2)]


def test_a_new_process_reads_the_timings_instead_of_measuring(store: Path) -> None:
    model = ee_model(every_layer=True)
    first = PrimitiveCosts(prepare(model, backend="eager"))
    values = _measure(first)
    assert first.measured_s > 0 and not store.exists()  # nothing written until persist()
    first.persist()
    (path,) = store.iterdir()
    assert path == cost_store.path_of(cost_store.store_key(first.runner, _kind(first.runner)))
    # a new process: a fresh copy of the model, its own runner and costs
    again = PrimitiveCosts(prepare(ee_model(every_layer=True), backend="eager"))
    assert _measure(again) == values and again.measured_s == 0.0
    before = path.read_text()
    os.utime(path, (1e9, 1e9))  # older than any write this test makes
    again.persist()  # nothing new: the file is left as it was
    assert path.stat().st_mtime == 1e9 and path.read_text() == before
    os.utime(path)
    # a shape not stored is measured, and persisting adds it
    again.layer(1)
    assert again.measured_s > 0
    again.persist()
    third = PrimitiveCosts(prepare(ee_model(every_layer=True), backend="eager"))
    third.layer(1)
    assert third.measured_s == 0.0


def test_the_key_follows_what_timings_depend_on(store: Path) -> None:
    model = ee_model(every_layer=True)
    runner = prepare(model, backend="eager")
    key = cost_store.store_key(runner, _kind(runner))
    assert cost_store.store_key(runner, _kind(runner)) == key
    wider = ee_model(every_layer=True, hidden=48)  # another shape
    other = prepare(wider, backend="eager")
    assert cost_store.store_key(other, _kind(other)) != key
    half = prepare(ee_model(every_layer=True).half(), backend="eager")  # another format
    assert cost_store.store_key(half, _kind(half)) != key
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(old + 1)  # another thread count
        assert cost_store.store_key(runner, _kind(runner)) != key
    finally:
        torch.set_num_threads(old)


def test_bad_old_or_foreign_files_are_measured_again(store: Path) -> None:
    model = ee_model(every_layer=True)
    first = PrimitiveCosts(prepare(model, backend="eager"))
    first.layer(1)
    first.persist()
    (path,) = store.iterdir()
    good = path.read_text()
    for text in ("not json", "[]", json.dumps({"format": 99, "timings": []}),
                 json.dumps({"format": 1, "timings": [[["layer", 1], "fast"]]}),
                 json.dumps({"format": 1, "timings": [[["layer", 1], -1.0]]}),
                 json.dumps({"format": 1, "timings": [[[["nested"]], 1.0]]})):
        path.write_text(text)
        costs = PrimitiveCosts(prepare(model, backend="eager"))
        costs.layer(1)
        assert costs.measured_s > 0, text
        costs.persist()  # replaced by a good file
        assert json.loads(path.read_text())["format"] == cost_store.FORMAT
    path.write_text(good)
    stale = time.time() - (cost_store.STORE_DAYS + 1) * 86400
    os.utime(path, (stale, stale))
    costs = PrimitiveCosts(prepare(model, backend="eager"))
    costs.layer(1)
    assert costs.measured_s > 0  # too old: measured again
    assert cost_store.load("0" * 32) == {}  # nothing stored under that name


def test_switched_off_nothing_is_read_or_written(store: Path, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    monkeypatch.setenv("EXITLM_COST_CACHE", "0")
    costs = PrimitiveCosts(prepare(ee_model(every_layer=True), backend="eager"))
    costs.layer(1)
    costs.persist()
    assert not store.exists()


def test_an_unwritable_cache_keeps_the_timings_in_the_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("EXITLM_CACHE", str(blocked))  # costs/ cannot be made under a file
    monkeypatch.setenv("EXITLM_COST_CACHE", "1")
    costs = PrimitiveCosts(prepare(ee_model(every_layer=True), backend="eager"))
    t = costs.layer(1)
    costs.persist()  # no error
    assert costs.layer(1) == t


def test_self_speculation_stores_its_planner_timings_and_the_cache_lists_them(
        store: Path) -> None:
    """An engine's adaptive planner times its primitives once: a second process with the same
    model reads them (and decodes the same tokens: timings choose rounds, never tokens)."""
    model = ee_model(every_layer=True)
    prompt = [[3, 5, 7, 9]]
    first = generate(model, None, prompt, strategy="self-spec", max_new_tokens=10,
                     ignore_eos=True)
    files = sorted(store.iterdir())
    assert files
    stamps = [p.stat().st_mtime_ns for p in files]
    fresh = ee_model(every_layer=True)  # a new process: nothing measured in memory
    second = generate(fresh, None, prompt, strategy="self-spec", max_new_tokens=10,
                      ignore_eos=True)
    assert second.token_ids == first.token_ids
    assert [p.stat().st_mtime_ns for p in sorted(store.iterdir())] == stamps  # read, not redone
    listed = cache_mod.entries(store.parent, kinds=["costs"])
    assert sorted(e.path for e in listed) == files
