"""Every decoding strategy on every runner against one eager reference (tests/_reference.py):
whole-prefix forwards of the model's own modules, no cache, no runner.

* lossless strategies - plain decoding, early exit at threshold 1, self-speculative decoding
  (any exit, draft length, draft vocabulary, draft threshold), PPD (any ``d_bar``, ``k``,
  branches serial or on threads) - emit exactly the reference's greedy tokens;
* confidence early exit with KV recomputation emits the reference's tokens *and exit layers*
  under the same exit rule (EE-LLM's: every key/value attended to is the full model's);
* a fixed exit emits the truncated model's greedy tokens.

Runners: ``eager`` (the model's modules), ``native`` (the CPU kernels of ``block.c``), and
``static`` (the CUDA-graph runner's static code, run eagerly). Models: LayerSkip-style shared
exits (Llama family), own MLP heads (GPT-2 family: learned positions, LayerNorm), own
transformer-block heads (their own cache slot); and a few cases on float models whose heads
alone are int8 (``quantize_heads``: the reference, plain decoding and every strategy use the
same int8 head). Prompts are decoded as one padded batch where
the strategy takes batches (PPD holds one sequence at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _ee_models import ee_model, random_prompts
from _reference import early_exit_reference, greedy_reference
from exitlm.infer import generate
from exitlm.kernels import native
from exitlm.kernels.quant import quantize
from exitlm.kernels.quantized import quantize_heads, set_tied_head
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime import prepare
from exitlm.runtime.runner import Runner

NEW = 16
RUNNERS = ("eager", "native", "static")
MODELS = {
    "layerskip": {"head": "linear", "every_layer": True},
    "gpt2-mlp": {"head": "mlp", "gpt2": True},
    "block": {"head": "block"},
}

LOSSLESS: list[tuple[str, dict[str, Any]]] = [
    ("ar", {}),
    ("early-exit", {"threshold": 1.0}),
    ("self-spec", {"exit_layer": 1, "num_speculations": 1}),
    ("self-spec", {"exit_layer": 2, "num_speculations": 4}),
    ("self-spec", {"exit_layer": 3, "num_speculations": 6, "draft_vocab": 7}),
    ("self-spec", {"exit_layer": 2, "num_speculations": 5, "draft_threshold": 0.6}),
    ("self-spec", {}),  # adaptive: exit and draft length chosen per step
    ("self-spec", {"exit_layer": 2}),  # adaptive draft length
    ("ppd", {"ppd_layer": 2, "ppd_k": 1}),
    ("ppd", {"ppd_layer": 3, "ppd_k": 3}),
    ("ppd", {"ppd_layer": 3, "ppd_k": 2, "parallel": False, "draft_vocab": 9}),
]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_MODELS: dict[str, EarlyExitLM] = {}


def _model(name: str) -> EarlyExitLM:
    """Model ``name`` of :data:`MODELS`; ``name+int8-head``: that model with its heads alone
    int8 - an int8 output copy of its tied embedding (``quantize_heads``), then made unlike
    the embedding, so that a path reading the float embedding as its head emits other tokens."""
    if name not in _MODELS:
        base, _, heads = name.partition("+")
        model = ee_model(**MODELS[base])  # type: ignore[arg-type]
        if heads == "int8-head":
            quantize_heads(model)
            other = torch.randn(model.embed_tokens.weight.shape,
                                generator=torch.Generator().manual_seed(5)) * 0.4
            set_tied_head(model, quantize(other, "int8"))
        _MODELS[name] = model
    return _MODELS[name]


def _runner(name: str, model: EarlyExitLM) -> Runner:
    if name == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    return prepare(model, backend=name)  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    torch.manual_seed(11)
    return random_prompts(sizes=(5, 9, 3))


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    strategy, opts = case
    return "-".join([strategy, *(f"{k}={v}" for k, v in opts.items())])


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("runner_name", RUNNERS)
@pytest.mark.parametrize("case", LOSSLESS, ids=[_case_id(c) for c in LOSSLESS])
def test_lossless_strategies_emit_the_reference_tokens(
        case: tuple[str, dict[str, Any]], runner_name: str, model_name: str) -> None:
    strategy, opts = case
    model = _model(model_name)
    runner = _runner(runner_name, model)
    prompts = _prompts()
    want = [greedy_reference(model, p, NEW) for p in prompts]
    batch = [prompts[0]] if strategy == "ppd" else prompts
    got = generate(runner, None, batch, strategy=strategy, max_new_tokens=NEW, **opts)
    assert got.token_ids == want[: len(batch)]
    if strategy == "ppd":  # one sequence at a time: the others on their own
        for p, w in zip(prompts[1:], want[1:], strict=True):
            assert generate(runner, None, [p], strategy=strategy, max_new_tokens=NEW,
                            **opts).token_ids[0] == w
    for seq in got.sequences:
        assert len(seq.exit_layers) == len(seq.token_ids) == NEW
        if strategy == "self-spec":
            exits = {opts["exit_layer"]} if "exit_layer" in opts else \
                set(range(1, model.num_layers))
            assert set(seq.exit_layers) <= exits | {model.num_layers}
        else:
            assert set(seq.exit_layers) == {model.num_layers}
    if strategy == "self-spec" and "num_speculations" in opts:  # adaptive may not draft
        assert got.stats.drafted > 0


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("runner_name", RUNNERS)
@pytest.mark.parametrize(("threshold", "max_pending"), [(0.3, 1), (0.3, 3), (0.6, 8)])
def test_kv_recomputation_emits_the_reference_tokens_and_exits(
        threshold: float, max_pending: int, runner_name: str, model_name: str) -> None:
    model = _model(model_name)
    runner = _runner(runner_name, model)
    prompts = _prompts()
    checks = (1, 2, 3)
    got = generate(runner, None, prompts, strategy="early-exit", threshold=threshold,
                   max_pending=max_pending, exit_layers=checks, max_new_tokens=NEW)
    early = 0
    for prompt, seq in zip(prompts, got.sequences, strict=True):
        ref, layers = early_exit_reference(model, prompt, NEW, checks, threshold, max_pending)
        assert seq.token_ids == ref
        assert seq.exit_layers == layers
        early += sum(x < model.num_layers for x in layers)
        run = 0  # never more than max_pending consecutive early exits
        for x in layers:
            run = run + 1 if x < model.num_layers else 0
            assert run <= max_pending
    assert early > 0  # the case really exercises early exits


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("runner_name", RUNNERS)
def test_a_fixed_exit_is_the_truncated_model(runner_name: str, model_name: str) -> None:
    model = _model(model_name)
    runner = _runner(runner_name, model)
    prompts = _prompts()
    got = generate(runner, None, prompts, strategy="early-exit", exit_layer=2,
                   max_new_tokens=NEW)
    assert got.token_ids == [greedy_reference(model, p, NEW, depth=2) for p in prompts]
    assert all(set(s.exit_layers) == {2} for s in got.sequences)


INT8_HEAD_MODELS = ("layerskip+int8-head", "block+int8-head")
INT8_HEAD_CASES = [LOSSLESS[i] for i in (0, 1, 3, 4, 9, 10)]


@pytest.mark.parametrize("model_name", INT8_HEAD_MODELS)
@pytest.mark.parametrize("runner_name", RUNNERS)
@pytest.mark.parametrize("case", INT8_HEAD_CASES, ids=[_case_id(c) for c in INT8_HEAD_CASES])
def test_lossless_strategies_with_an_int8_head(
        case: tuple[str, dict[str, Any]], runner_name: str, model_name: str) -> None:
    """Int8 heads on a float model (issue 34): every lossless strategy emits the reference's
    tokens with the same int8 head (drafts, PPD's top-k and the native chain's head included)."""
    strategy, opts = case
    model = _model(model_name)
    assert model.tied_head is not None  # the float embedding's int8 output copy
    runner = _runner(runner_name, model)
    prompts = _prompts()[:2]
    want = [greedy_reference(model, p, NEW) for p in prompts]
    for batch in ([[p] for p in prompts] if strategy == "ppd" else [prompts]):
        got = generate(runner, None, batch, strategy=strategy, max_new_tokens=NEW, **opts)
        assert got.token_ids == [want[prompts.index(p)] for p in batch]


@pytest.mark.parametrize("model_name", INT8_HEAD_MODELS)
@pytest.mark.parametrize("runner_name", RUNNERS)
def test_kv_recomputation_with_an_int8_head(runner_name: str, model_name: str) -> None:
    """Confidence early exit with KV recomputation probes the int8 head (one sequence at a
    time: the native segments' own product on the int8 weight): the reference's tokens and
    exits. The reference multiplies the head with float activations, so the native runtime's
    int8-activation heads are switched off here (they are checked in
    tests/kernels/test_quantized_heads.py)."""
    model = _model(model_name)
    previous = native.set_int8_activations(False) if native.available() else None
    try:
        runner = _runner(runner_name, model)
        early = _early_exits_match(runner, model)
    finally:
        if previous is not None:
            native.set_int8_activations(previous)
    assert early > 0


def _early_exits_match(runner: Runner, model: EarlyExitLM) -> int:
    early = 0
    for prompt in _prompts():
        seq = generate(runner, None, [prompt], strategy="early-exit", threshold=0.3,
                       max_pending=3, exit_layers=(1, 2, 3), max_new_tokens=NEW).sequences[0]
        ref, layers = early_exit_reference(model, prompt, NEW, (1, 2, 3), 0.3, 3)
        assert (seq.token_ids, seq.exit_layers) == (ref, layers)
        early += sum(x < model.num_layers for x in layers)
    return early
