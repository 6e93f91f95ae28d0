"""The weights' huge-page arena (exitlm.runtime.memory): every CPU weight moves into one
2 MiB-aligned mapping with its value, dtype, strides and shared storage kept; decoding gives
the same tokens; nothing moves twice, nor in a model being trained, nor what another process
or a file maps, nor when turned off."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from _byte_models import sharp_byte_model
from _native import needs_native
from exitlm.infer import generate
from exitlm.runtime import memory, prepare

pytestmark = pytest.mark.skipif(not memory.huge_pages_available(),
                                reason="no transparent huge pages here (Linux only)")


def _model() -> torch.nn.Module:
    model = sharp_byte_model(num_layers=3, max_seq_len=64)
    # a buffer that views a parameter's storage: the two must keep sharing it
    model.register_buffer("embed_rows", model.embed_tokens.weight.data[8:40], persistent=False)
    return model


def _arena_range(model: torch.nn.Module) -> tuple[int, int]:
    arena = memory._arenas[model]
    return arena.data_ptr(), arena.data_ptr() + arena.numel()


def test_every_weight_moves_into_one_aligned_arena_with_its_value() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()}
    objects = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    assert not memory.placed(model)
    assert memory.place_weights(model, min_bytes=0)
    assert memory.placed(model)
    lo, hi = _arena_range(model)
    assert lo % memory.HUGE_PAGE == 0
    after = model.state_dict(keep_vars=True)
    for name, t in after.items():
        assert lo <= t.data_ptr() < hi, name
        assert id(t) == objects[name], name  # the same tensor objects, pointed elsewhere
        assert torch.equal(t, before[name]), name
        assert t.stride() == before[name].stride()
    embed = model.embed_tokens.weight
    assert model.embed_rows.data_ptr() == embed[8].data_ptr()
    with torch.no_grad():
        embed[8, 0] += 1.0  # still one storage: the view sees the change
    assert model.embed_rows[0, 0] == embed[8, 0]


@needs_native  # the native runner reads the weights where they are; the eager one relays
# fp32 weights (layout.restride) and re-places them only past memory.MIN_BYTES
def test_decoding_gives_the_same_tokens_and_a_second_call_copies_nothing() -> None:
    model = _model()
    prompt = [[3, 7, 11, 5]]
    kw = {"max_new_tokens": 12, "ignore_eos": True}
    # (the eager runner lays fp32 weights out otherwise: on a copy, not to move them twice)
    reference = generate(prepare(copy.deepcopy(model), backend="eager"), None, prompt,
                         **kw).token_ids
    memory.place_weights(model, min_bytes=0)
    pointers = [t.data_ptr() for t in model.state_dict().values()]
    assert generate(prepare(model), None, prompt, **kw).token_ids == reference
    assert memory.place_weights(model, min_bytes=0)
    assert [t.data_ptr() for t in model.state_dict().values()] == pointers


def test_a_weight_moved_away_puts_the_model_back_into_a_new_arena() -> None:
    model = _model()
    memory.place_weights(model, min_bytes=0)
    first = _arena_range(model)
    model.norm.weight.data = model.norm.weight.data.clone()
    assert not memory.placed(model)
    assert memory.place_weights(model, min_bytes=0)
    assert _arena_range(model) != first and memory.placed(model)


def test_inference_tensors_stay_inference_tensors() -> None:
    model = _model()
    with torch.inference_mode():
        made = torch.randn(64, 64)
    model.register_buffer("made_in_inference", made)
    memory.place_weights(model, min_bytes=0)
    assert model.made_in_inference.is_inference()
    assert memory.placed(model)


def test_left_alone_trained_models_shared_memory_mapped_files_and_when_turned_off(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    trained = _model()
    trained(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    pointers = [p.data_ptr() for p in trained.parameters()]
    assert not memory.place_weights(trained, min_bytes=0)
    assert [p.data_ptr() for p in trained.parameters()] == pointers
    assert not memory.place_weights(_model().train(), min_bytes=0)

    shared = _model()
    shared.norm.weight.data.share_memory_()
    where = shared.norm.weight.data_ptr()
    assert memory.place_weights(shared, min_bytes=0)
    assert shared.norm.weight.data_ptr() == where  # another process may map it
    assert shared.embed_tokens.weight.data_ptr() != where

    mapped = _model()  # a weight read in place from a file (a safetensors checkpoint)
    path = tmp_path / "norm.bin"
    mapped.norm.weight.data.numpy().tofile(path)
    mapped.norm.weight.data = torch.from_file(str(path), size=mapped.norm.weight.numel())
    where = mapped.norm.weight.data_ptr()
    assert memory.place_weights(mapped, min_bytes=0) and memory.placed(mapped)
    assert mapped.norm.weight.data_ptr() == where

    small = _model()
    assert not memory.place_weights(small)  # under MIN_BYTES: nothing to win

    monkeypatch.setenv("EXITLM_HUGE_PAGES", "0")
    assert not memory.huge_pages_available()
    assert not memory.place_weights(_model(), min_bytes=0)

