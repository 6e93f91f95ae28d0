"""Exit-head bundles (exit tuning output, ``default-ee``) and head initialisation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _default_model import requires_default_model
from exitlm.config import DraftHint, ExitConfig, preset
from exitlm.infer.per_exit import evaluate_exits
from exitlm.io import load_model, save_model
from exitlm.io.bundle import find_bundle, save_bundle
from exitlm.model.transformer import EarlyExitLM
from exitlm.train.tuning import freeze_backbone, init_heads_from_final


def test_init_heads_from_final_copies_final_parts() -> None:
    model = EarlyExitLM(preset("debug", exits=ExitConfig(layers=(1, 2), head="mlp",
                                                         output="own")))
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    init_heads_from_final(model, [1, 2])
    head, last = model.exits["2"], model.layers[-1]
    torch.testing.assert_close(head.norm.weight, model.norm.weight)
    torch.testing.assert_close(head.proj.weight, model.output_embedding())
    torch.testing.assert_close(head.mlp.w_in.weight, last.mlp.w_in.weight)
    torch.testing.assert_close(head.mlp_norm.weight, last.norm_mlp.weight)
    names = freeze_backbone(model)
    assert names and all(n.startswith("exits.") for n in names)
    assert not model.embed_tokens.weight.requires_grad


def test_bundle_round_trip(tmp_path: Path) -> None:
    base = EarlyExitLM(preset("debug", exits=ExitConfig()))
    save_model(base, tmp_path / "base")
    tuned = load_model(str(tmp_path / "base"), exits=ExitConfig(layers=(2,), head="mlp")).model
    with torch.no_grad():
        for p in tuned.exits.parameters():
            p.add_(0.01 * torch.randn_like(p))
    bundle = save_bundle(tuned, tmp_path / "exits", str(tmp_path / "base"),
                         dtype=torch.float32)
    assert find_bundle(str(bundle)) == bundle
    loaded = load_model(str(bundle))
    assert loaded.config.exits.layers == (2,)
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        a = tuned(x, exit_layers=(2,)).exit_logits[2]
        b = loaded.model(x, exit_layers=(2,)).exit_logits[2]
    torch.testing.assert_close(a, b)
    assert find_bundle("default-ee") is not None
    # a measured best round and early-exit threshold travel with the heads
    hinted = load_model(str(tmp_path / "base"),
                        exits=ExitConfig(layers=(2,), head="mlp", draft=DraftHint(2, 3),
                                         threshold=0.97)).model
    again = save_bundle(hinted, tmp_path / "hinted", str(tmp_path / "base"))
    exits = load_model(str(again)).config.exits
    assert (exits.draft, exits.threshold) == (DraftHint(2, 3), 0.97)


@pytest.mark.real_model
@requires_default_model
def test_default_ee_agrees_with_final_more_than_untuned() -> None:
    from exitlm.io.corpus import DataConfig, is_held_out, list_sources

    tuned = load_model("default-ee")
    layers = list(tuned.config.exits.layers)
    assert layers and tuned.tokenizer is not None
    cfg = DataConfig()
    held_out = [p for k, p in list_sources(cfg) if is_held_out(k, cfg.val_fraction, cfg.seed)]
    ids = tuned.tokenizer.encode(held_out[0].read_text(encoding="utf-8"))[:257]
    x = torch.tensor([ids])
    batch = [(x[:, :-1], x[:, 1:])]
    after = {m.layer: m.agree_top1 for m in evaluate_exits(tuned.model, batch, layers)}
    untuned = load_model("default").model
    before = {m.layer: m.agree_top1 for m in evaluate_exits(untuned, batch, layers)}
    for k in layers:
        assert after[k] > before[k] + 0.05, (k, before[k], after[k])
