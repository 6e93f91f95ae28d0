"""Multi-exit loss: gradients, weights, layer dropout, config errors."""

from __future__ import annotations

import pytest
import torch

from exitlm.config import ConfigError, ExitConfig, preset
from exitlm.model.transformer import EarlyExitLM
from exitlm.train.layer_dropout import LayerDropout, sample_active
from exitlm.train.losses import LossConfig, exit_kl, lm_cross_entropy, multi_exit_loss


def _model(**exits: object) -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(**exits)) if exits else preset("debug")
    return EarlyExitLM(cfg)


def _batch(b: int = 3, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 256, (b, t + 1))
    return x[:, :-1], x[:, 1:]


def _grads(model: EarlyExitLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_multi_exit_gradients_equal_sum_of_independent_losses() -> None:
    model = _model(layers=(1, 2), norm="own")
    tokens, labels = _batch()
    weights = {1: 0.3, 2: 0.5, 4: 1.0}
    res = multi_exit_loss(model, tokens, labels, weights)
    res.total.backward()
    ours = _grads(model)
    model.zero_grad()
    # independently: one full forward per exit, each loss backpropagated on its own
    for layer, w in weights.items():
        out = model(tokens, exit_layers=(1, 2))
        logits = out.logits if layer == 4 else out.exit_logits[layer]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
        assert res.per_exit[layer] == pytest.approx(loss.item(), rel=1e-5)
        (w * loss).backward()
    ref = _grads(model)
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_zero_weight_exits_are_not_computed_and_forward_stops_early() -> None:
    model = _model(layers=(1, 2))
    calls: list[int] = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    heads: list[int] = []
    model.exits["1"].register_forward_hook(lambda *a: heads.append(1))
    tokens, labels = _batch()
    res = multi_exit_loss(model, tokens, labels, {1: 0.0, 2: 1.0, 4: 0.0})
    assert set(res.per_exit) == {2}
    assert calls == [0, 1]  # layers 3 and 4 never ran


def test_ignore_index() -> None:
    logits = torch.randn(2, 3, 7)
    labels = torch.tensor([[1, -100, 2], [-100, -100, 6]])
    keep = labels != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(lm_cross_entropy(logits, labels), ref)
    assert lm_cross_entropy(logits, torch.full((2, 3), -100)).item() == 0.0


def test_layer_dropout_p0_equals_no_dropout() -> None:
    model = _model(layers=(2,))
    tokens, labels = _batch()
    w = {2: 0.5, 4: 1.0}
    ref = multi_exit_loss(model, tokens, labels, w).total
    drop = LayerDropout(p_max=0.0)
    assert drop.sample(3, 4, 5, 10) is None
    active = sample_active(3, [0.0] * 4, torch.Generator().manual_seed(0))
    assert active is None
    out = multi_exit_loss(model, tokens, labels, w, active=[None] * 4).total
    torch.testing.assert_close(out, ref)


def test_layer_dropout_skips_compute_and_matches_identity() -> None:
    model = _model(layers=(2,))
    rows_seen: list[int] = []
    for layer in model.layers:
        layer.register_forward_hook(lambda m, a, o: rows_seen.append(a[0].shape[0]))
    tokens, labels = _batch(b=8)
    active = sample_active(8, [0.0, 0.5, 0.5, 1.0], torch.Generator().manual_seed(3))
    assert active is not None and active[0] is None and active[3].numel() == 0
    res = multi_exit_loss(model, tokens, labels, {4: 1.0}, active=active)
    assert rows_seen[0] == 8
    assert rows_seen[1:] == [int(a.numel()) for a in active[1:3]]  # layer 4 never ran
    assert sum(rows_seen) < 8 * 3
    # reference: skipped rows pass through unchanged (x_{l+1} = x_l, LayerSkip Eq. 1)
    h = model.embed(tokens)
    for i, rows in enumerate(active):
        full = model.run_layers(h, i, i + 1)
        keep = torch.zeros(8, dtype=torch.bool)
        if rows is None:
            keep[:] = True
        else:
            keep[rows] = True
        h = torch.where(keep[:, None, None], full, h)
    ref = lm_cross_entropy(model.final_logits(h), labels)
    torch.testing.assert_close(res.total, ref, rtol=1e-5, atol=1e-6)


def test_dropout_same_pattern_for_same_seed_and_step() -> None:
    d = LayerDropout(p_max=0.5, seed=7)
    a = d.sample(16, 4, step=3, total_steps=10)
    b = d.sample(16, 4, step=3, total_steps=10)
    c = d.sample(16, 4, step=4, total_steps=10)
    assert a is not None and b is not None and c is not None
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not (x is None and y is None) and (x is None or y is None or not torch.equal(x, y))
               for x, y in zip(a, c, strict=True))


def test_exit_kl_is_zero_at_the_teacher_and_skips_ignored_positions() -> None:
    teacher = torch.randn(2, 3, 7)
    logp = torch.log_softmax(teacher, -1)
    labels = torch.tensor([[1, -100, 2], [-100, -100, 6]])
    assert exit_kl(logp, teacher + 3.0, labels).item() == pytest.approx(0.0, abs=1e-6)
    student = torch.randn(2, 3, 7)
    keep = labels != -100
    ref = torch.nn.functional.kl_div(torch.log_softmax(student[keep], -1), logp[keep],
                                     log_target=True, reduction="batchmean")
    torch.testing.assert_close(exit_kl(logp, student, labels), ref)
    # a student changed only where labels are ignored pays nothing more
    moved = student.clone()
    moved[0, 1] += 5.0
    torch.testing.assert_close(exit_kl(logp, moved, labels), ref)


def test_distill_mixes_kl_towards_the_detached_final_output() -> None:
    """``distill = a``: every weighted exit pays ``(1 - a) CE + a KL(final || exit)``, the
    final output its own CE; the teacher carries no gradient, so the layers after the
    deepest early exit are trained by the final CE alone."""
    model = _model(layers=(1, 2))
    tokens, labels = _batch()
    weights = {1: 0.3, 2: 0.5, 4: 1.0}
    a = 0.6
    res = multi_exit_loss(model, tokens, labels, weights, distill=a)
    res.total.backward()
    ours = _grads(model)
    model.zero_grad()
    out = model(tokens, exit_layers=(1, 2))
    teacher = torch.log_softmax(out.logits.detach(), -1)
    ref_total = 0.0
    for layer, w in weights.items():
        logits = out.logits if layer == 4 else out.exit_logits[layer]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
        assert res.per_exit[layer] == pytest.approx(ce.item(), rel=1e-5)  # logged: the CE
        if layer == 4:
            term = ce
        else:
            kl = torch.nn.functional.kl_div(torch.log_softmax(logits, -1).reshape(-1, 256),
                                            teacher.reshape(-1, 256), log_target=True,
                                            reduction="batchmean")
            assert kl.item() > 0
            term = (1 - a) * ce + a * kl
        ref_total = ref_total + w * term
    assert res.total.item() == pytest.approx(float(ref_total.detach()), rel=1e-5)
    ref_total.backward()
    ref = _grads(model)
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # layers 3-4 only see the final CE, with or without distillation
    model.zero_grad()
    multi_exit_loss(model, tokens, labels, weights).total.backward()
    plain = _grads(model)
    for name in ref:
        if name.startswith(("layers.2.", "layers.3.")):
            torch.testing.assert_close(ours[name], plain[name], rtol=1e-4, atol=1e-7, msg=name)


def test_distill_runs_the_final_layer_as_teacher_even_without_its_weight() -> None:
    model = _model(layers=(1, 2))
    tokens, labels = _batch()
    res = multi_exit_loss(model, tokens, labels, {1: 1.0, 4: 0.0}, distill=1.0)
    assert set(res.per_exit) == {1}
    res.total.backward()
    out = model(tokens, exit_layers=(1,))
    teacher = torch.log_softmax(out.logits.detach(), -1)
    kl = exit_kl(teacher, out.exit_logits[1], labels)
    assert res.total.item() == pytest.approx(kl.item(), rel=1e-5)
    grads = _grads(model)
    assert any(n.startswith("layers.0.") for n in grads)
    assert not any(n.startswith(("layers.1.", "layers.2.", "layers.3.")) for n in grads)


def test_loss_config_weights() -> None:
    cfg = preset("debug", exits=ExitConfig(layers=(1, 2)))
    ee = LossConfig(kind="ee-llm", exit_weights=(0.25, 0.5), final_weight=1.0,
                    weight_schedule="warmup", weight_steps=4)
    assert ee.weights_at(0, cfg, 10) == pytest.approx({1: 0.0, 2: 0.0, 4: 1.0})
    assert ee.weights_at(2, cfg, 10) == pytest.approx({1: 0.125, 2: 0.25, 4: 1.0})
    ls = LossConfig(kind="layerskip", e_scale=1.0, curriculum="none")
    every = preset("debug", exits=ExitConfig(every_layer=True, norm="final"))
    # e = [0, 1, 3, 3 + 3] -> normalized by 10
    assert ls.weights_at(0, every, 10) == pytest.approx({1: 0.0, 2: 0.1, 3: 0.3, 4: 0.6})
    rot = LossConfig(kind="layerskip", e_scale=1.0, curriculum="rotational", rotation=2)
    assert rot.weights_at(1, every, 10) == pytest.approx({2: 1 / 7, 4: 6 / 7})
    assert LossConfig().weights_at(0, cfg, 10) == {4: 1.0}


def test_loss_config_errors() -> None:
    cfg = preset("debug", exits=ExitConfig(layers=(1, 2)))
    with pytest.raises(ConfigError, match="2 exits"):
        LossConfig(kind="ee-llm", exit_weights=(0.1, 0.2, 0.3)).validate(cfg, 10)
    with pytest.raises(ConfigError, match="exit_weights_initial"):
        LossConfig(kind="ee-llm", weight_schedule="cooldown", weight_steps=3).validate(cfg, 10)
    with pytest.raises(ConfigError, match="needs exits"):
        LossConfig(kind="ee-llm").validate(preset("debug", exits=ExitConfig()), 10)
    with pytest.raises(ConfigError, match=r"loss\.kind"):
        LossConfig(kind="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="curriculum"):
        LossConfig(kind="layerskip", curriculum="sideways")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"loss\.distill=0\.5 .*loss\.kind=final"):
        LossConfig(kind="final", distill=0.5)
    with pytest.raises(ConfigError, match=r"loss\.distill"):
        LossConfig(kind="layerskip", distill=1.5)
    with pytest.raises(ConfigError, match="exits are counted from 1"):
        preset("debug", exits=ExitConfig(layers=(4,)))
