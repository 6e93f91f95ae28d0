"""Unit tests of the early-exit transformer: exits, KV cache, layer slicing, layout, errors."""

from __future__ import annotations

import pytest
import torch

from exitlm.config import ConfigError, DraftHint, ExitConfig, ModelConfig, preset
from exitlm.model.transformer import EarlyExitLM


def _model(**exit_kw: object) -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(**exit_kw))  # type: ignore[arg-type]
    return EarlyExitLM(cfg).eval()


@pytest.mark.parametrize("head", ["linear", "mlp", "block"])
@pytest.mark.parametrize("norm", ["none", "own", "final"])
@pytest.mark.parametrize("output", ["tied_embedding", "final_head", "own"])
def test_exit_heads_compose_from_pieces(head: str, norm: str, output: str) -> None:
    """forward()'s exit logits equal embed -> run_layers -> exit_logits composed by hand."""
    model = _model(layers=(1, 3), head=head, norm=norm, output=output)
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        out = model(tokens)
        h = model.embed(tokens)
        h1 = model.run_layers(h, 0, 1)
        h3 = model.run_layers(h1, 1, 3)
        torch.testing.assert_close(out.exit_logits[1], model.exit_logits(h1, 1))
        torch.testing.assert_close(out.exit_logits[3], model.exit_logits(h3, 3))
        hl = model.run_layers(h3, 3, 4)
        torch.testing.assert_close(out.logits, model.final_logits(hl))
        torch.testing.assert_close(model.exit_logits(hl, 4), out.logits)
    assert set(out.exit_logits) == {1, 3}


def test_exit_parameter_sharing() -> None:
    shared = _model(layers=(2,), head="linear", norm="final", output="final_head")
    assert shared.num_parameters(exits_only=True) == 0
    own = _model(layers=(2,), head="mlp", norm="own", output="own")
    cfg = own.config
    expected = (cfg.dim * 2 * cfg.hidden_dim + cfg.hidden_dim * cfg.dim) + 2 * cfg.dim + (
        cfg.dim * cfg.vocab_size
    )
    assert own.num_parameters(exits_only=True) == expected


def test_every_layer_exits_through_final_head() -> None:
    model = _model(every_layer=True)
    assert model.config.exit_layers == (1, 2, 3)
    h = model.run_layers(model.embed(torch.randint(0, 256, (1, 5))), 0, 2)
    torch.testing.assert_close(model.exit_logits(h, 2), model.final_logits(h))


def test_missing_exit_is_a_clear_error() -> None:
    model = _model(layers=(1,))
    h = torch.zeros(1, 2, model.config.dim)
    with pytest.raises(ValueError, match="2 is not an exit of this model"):
        model.exit_logits(h, 2)


def test_block_exit_uses_its_own_cache_slot() -> None:
    """A block exit attends over earlier tokens: cached decoding equals the full forward."""
    model = _model(layers=(2,), head="block")
    assert model.num_cache_slots == model.num_layers + 1
    tokens = torch.randint(0, 256, (1, 12))
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        full = model(tokens).exit_logits[2]
        first = model(tokens[:, :7], cache=cache).exit_logits[2]
        rest = [
            model(tokens[:, p : p + 1], torch.tensor([[p]]), cache=cache).exit_logits[2]
            for p in range(7, 12)
        ]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, atol=1e-5, rtol=1e-4)


def test_cache_crop_and_per_layer_fill() -> None:
    """Early exiting leaves deep layers unfilled; crop rolls back; rewriting repairs."""
    model = _model(layers=(2,))
    tokens = torch.randint(0, 256, (1, 10))
    cache = model.new_cache(1, 16)
    with torch.no_grad():
        ref = model(tokens).logits
        model(tokens[:, :8], cache=cache)
        # token 8 only through the first two layers (as an early exit would)
        h = model.run_layers(model.embed(tokens[:, 8:9]), 0, 2, torch.tensor([[8]]), cache)
        assert cache.fill[:, 0].tolist() == [9, 9, 8, 8, 0][: cache.num_slots]
        # KV recomputation: run the pending token through the layers it skipped
        model.run_layers(h, 2, 4, torch.tensor([[8]]), cache)
        assert cache.fill[:4, 0].tolist() == [9, 9, 9, 9]
        cache.crop(6)
        assert cache.fill[:4, 0].tolist() == [6, 6, 6, 6]
        out = model(tokens[:, 6:10], torch.arange(6, 10)[None], cache=cache).logits
    torch.testing.assert_close(out, ref[:, 6:10], atol=1e-5, rtol=1e-4)


def test_cache_overflow_and_bad_positions() -> None:
    model = _model()
    cache = model.new_cache(2, 4)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(2, 5, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="positions must have shape"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)


def test_fp16_prefill_matches_fp32_reference() -> None:
    model = _model()
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        ref = model(tokens).logits
        half = model.half()(tokens).logits.float()
    torch.testing.assert_close(half, ref, atol=2e-2, rtol=2e-2)


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"exits\.layers"):
        preset("debug", exits=ExitConfig(layers=(4,)))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match=r"exits\.head"):
        ExitConfig(head="conv")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown model config keys"):
        ModelConfig.from_dict({"dim": 64, "dimm": 3})
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("nope")


def test_config_json_round_trip() -> None:
    cfg = preset("debug", exits=ExitConfig(layers=(1, 2), head="mlp", every_layer=True))
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    hinted = preset("debug", exits=ExitConfig(layers=(1, 2), draft=DraftHint(2, 5)))
    assert ModelConfig.from_json(hinted.to_json()) == hinted


def test_a_draft_hint_names_one_of_the_models_exits() -> None:
    base = preset("debug", exits=ExitConfig(layers=(1, 2))).to_dict()

    def load(draft: object) -> ModelConfig:
        return ModelConfig.from_dict({**base, "exits": {**base["exits"], "draft": draft}},
                                     where="m/config.json")

    assert load({"exit_layer": 1, "num_speculations": 3}).exits.draft == DraftHint(1, 3)
    with pytest.raises(ConfigError, match=r"m/config\.json: exits\.draft\.exit_layer is 3, "
                                          r"which is not an exit of this model.*\(1, 2\)"):
        load({"exit_layer": 3, "num_speculations": 3})
    with pytest.raises(ConfigError, match=r"exits\.draft\.num_speculations: expected an "
                                          r"integer in \[1, 64\], got 0"):
        load({"exit_layer": 1, "num_speculations": 0})
    with pytest.raises(ConfigError, match=r"exits\.draft: missing key 'num_speculations'"):
        load({"exit_layer": 1})
    assert load({"exit_layer": 1, "num_speculations": 3, "weights": "int8"}).exits.draft == (
        DraftHint(1, 3, "int8"))
    with pytest.raises(ConfigError, match=r"exits\.draft\.weights: expected one of .*'int4'"
                                          r".*got 'int2'"):
        load({"exit_layer": 1, "num_speculations": 3, "weights": "int2"})
    with pytest.raises(ConfigError, match=r"unknown .*keys \['e'\]"):
        load({"e": 1, "exit_layer": 1, "num_speculations": 2})


def test_model_code_has_no_distributed_imports() -> None:
    import ast
    import pathlib

    import exitlm.model as pkg

    for path in pathlib.Path(pkg.__path__[0]).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                assert not any("torch.distributed" in n for n in names), path


def test_layer_dropout_rows_skip_layers_and_get_gradients() -> None:
    """``active`` rows run a layer, the others pass through unchanged (LayerSkip Eq. 1)."""
    model = _model()
    tokens = torch.randint(0, 256, (3, 6))
    h0 = model.embed(tokens)
    keep = [torch.tensor([0, 2]), None, torch.tensor([], dtype=torch.long), torch.tensor([1])]
    out = model.run_layers(h0, 0, 4, active=keep)
    # row 1 skipped layer 0 and layer 2; row 0 skipped layers 2 and 3
    ref1 = model.run_layers(model.run_layers(h0[1:2], 1, 2), 3, 4)
    ref0 = model.run_layers(h0[0:1], 0, 2)
    torch.testing.assert_close(out[1:2], ref1)
    torch.testing.assert_close(out[0:1], ref0)
    out.sum().backward()
    assert model.layers[3].mlp.w_out.weight.grad is not None
    assert model.layers[2].mlp.w_out.weight.grad is None


def test_cache_row_views_are_kept_until_the_cache_is_reallocated() -> None:
    """``rows(lo, hi)`` gives the same view (a runner keys what it prepared by its tensors)
    writing through to the pool, until ``resize`` reallocates; then a view of the new storage
    that kept the rows' contents."""
    from exitlm.model.kv_cache import KVCache

    cache = KVCache(2, 4, 16, 2, 8)
    view = cache.rows(1, 3)
    assert cache.rows(1, 3) is view and cache.rows(0, 2) is not view
    view.keys[0][0, :, 5] = 1.5
    view.lengths = torch.tensor([6, 2])
    assert bool((cache.keys[0][1, :, 5] == 1.5).all())
    assert cache.lengths.tolist() == [0, 6, 2, 0]
    cache.resize(4, 32)
    again = cache.rows(1, 3)
    assert again is not view and again.max_seq_len == 32
    assert again.keys[0].data_ptr() == cache.keys[0][1:3].data_ptr()
    assert bool((again.keys[0][0, :, 5] == 1.5).all()) and again.lengths.tolist() == [6, 2]
