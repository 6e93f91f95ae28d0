"""``prepare`` builds a runner beside the model and leaves the model as it was: its class, its
modules' classes, its methods, its state dict and values (re-strided weights at most); several
runners and engines share one model; training it afterwards gives the gradients it gave."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

from _byte_models import sharp_model
from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.infer import Engine, SamplingOptions, generate
from exitlm.kernels import native
from exitlm.model import layers
from exitlm.runtime import BACKENDS, GraphRunner, NativeRunner, Runner, prepare

SRC = Path(__file__).resolve().parents[2] / "src" / "exitlm"


def _model(dtype: torch.dtype = torch.float32, **exit_kw: object) -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(**exit_kw))  # type: ignore[arg-type]
    return EarlyExitLM(cfg).eval().to(dtype)


@pytest.mark.parametrize("backend", ["eager", "native", "static"])
def test_the_model_is_left_as_it_was(backend: str) -> None:
    if backend == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    model = _model(layers=(1,), output="own")
    values = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    classes = (type(model), [type(m) for m in model.modules()])
    attrs = set(model.__dict__)
    runner = prepare(model, backend=backend, pack_rows=True)  # type: ignore[arg-type]
    generate(runner, None, [[1, 2, 3], [4, 5]], strategy="self-spec", max_new_tokens=6)
    assert (type(model), [type(m) for m in model.modules()]) == classes
    assert set(model.__dict__) == attrs  # no method or state put on the instance
    assert not any("forward" in m.__dict__ or "project" in m.__dict__ for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(values)
    for k, v in after.items():
        assert torch.equal(v, values[k]), k
    for k, p in model.named_parameters():
        assert p is params[k], k  # the same Parameter objects, re-strided at most


def test_auto_picks_the_device_s_runner() -> None:
    model = _model()
    runner = prepare(model)
    assert type(runner) is (NativeRunner if native.available() else Runner)
    assert isinstance(prepare(model, backend="static"), GraphRunner)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        prepare(model, backend="graphs")
    with pytest.raises(ValueError, match="unknown runtime backend"):
        prepare(model, backend="fast")  # type: ignore[arg-type]
    fused = prepare(model, backend="fused")  # off CUDA: the compiled static code, no graphs
    assert isinstance(fused, GraphRunner) and not fused.capture and fused.kind == "fused"
    assert fused.fused is not None and fused.fused.compiler == "inductor"
    assert set(BACKENDS) == {"auto", "eager", "native", "graphs", "fused", "static"}


def test_several_engines_share_one_model() -> None:
    """Two engines on one model, with different strategies and runners, stepped in turns,
    give what each gives alone."""
    model = sharp_model(preset("debug", exits=ExitConfig(every_layer=True, norm="final")))
    prompt = [5, 17, 42, 7]
    alone = generate(model, None, [prompt], max_new_tokens=10).token_ids[0]
    assert len(set(alone)) > 2  # not a constant output
    first = Engine(model, None, "ar", max_batch=1)
    second = Engine(prepare(model, backend="eager"), None, "self-spec", max_batch=2)
    reqs = [e.submit(prompt, SamplingOptions(max_new_tokens=10)) for e in (first, second)]
    while first.has_work() or second.has_work():
        first.step()
        second.step()
    assert [r.token_ids for r in reqs] == [alone, alone]


def test_greedy_tokens_equal_full_forwards() -> None:
    """Every runner's plain decoding equals greedy decoding by full forwards without a cache
    (fp32 and bf16)."""
    prompt = [5, 17, 42, 7]
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype, layers=(1,))
        ref = _greedy(model, prompt)
        for backend in ("eager", "auto", "static"):
            runner = prepare(model, backend=backend)  # type: ignore[arg-type]
            got = generate(runner, None, [prompt], max_new_tokens=12, threads=1).token_ids[0]
            assert got == ref, (dtype, backend)


def _greedy(model: EarlyExitLM, prompt: list[int]) -> list[int]:
    """12 greedy tokens by full forwards (no cache)."""
    with torch.no_grad():
        tokens = torch.tensor([prompt])
        out = []
        for _ in range(12):
            nxt = int(model(tokens).logits[0, -1].argmax())
            out.append(nxt)
            tokens = torch.cat([tokens, torch.tensor([[nxt]])], dim=1)
    return out


def test_training_after_decoding_gives_the_same_gradients() -> None:
    plain = _model(layers=(1,))
    used = copy.deepcopy(plain)
    generate(prepare(used, pack_rows=True), None, [[1, 2, 3]], max_new_tokens=4)
    tokens = torch.randint(0, 256, (2, 9))
    grads = []
    for m in (plain, used):
        m.train()
        out = m(tokens)
        loss = out.logits.float().logsumexp(-1).mean() + out.exit_logits[1].float().mean()
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k


def test_a_runner_follows_in_place_weight_updates() -> None:
    """An optimizer step changes weights in place: the runner's next forwards use them."""
    model = _model(torch.bfloat16)
    runner = prepare(model)
    tokens = torch.tensor([[3, 4, 5]])
    pos = torch.arange(3)[None]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            h = runner.layers(runner.embed(tokens, pos), 0, model.num_layers, pos, None)
            return runner.logits(h, model.num_layers)

    before = logits()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
        want = model(tokens).logits
    after = logits()
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_no_class_swaps_or_method_patches_in_src() -> None:
    """Nothing in src/ assigns ``__class__`` or a method onto an instance (``x.forward =``,
    ``model.project =``, ``model.new_cache =``)."""
    methods = {"forward", "project", "new_cache", "run_layers", "exit_logits", "embed"}
    bad = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and (t.attr == "__class__" or (
                        t.attr in methods and not (isinstance(t.value, ast.Name)
                                                   and t.value.id == "self"))):
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} {t.attr}")
    assert not bad, bad


def test_layers_module_is_plain_arithmetic() -> None:
    """``model/layers.py`` imports no numpy / ctypes and nothing of torch's internals."""
    tree = ast.parse(Path(layers.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    assert not names & {"numpy", "ctypes", "glob", "weakref", "torch.nn.modules"}
    assert {n.split(".")[0] for n in names} <= {"__future__", "collections", "math", "torch",
                                                "exitlm"}
