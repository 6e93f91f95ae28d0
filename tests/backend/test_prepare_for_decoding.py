"""``prepare_for_decoding``: applied once, in place, without changing what the model is
(state dict, values, gradients, greedy output), and ``model/layers.py`` stays plain."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import torch

from exitlm import EarlyExitLM, ExitConfig, preset
from exitlm.backend import cpu, native
from exitlm.backend.cpu import is_prepared, prepare_for_decoding
from exitlm.backend.decode_block import LeanBlock
from exitlm.backend.linear import FastLinear
from exitlm.infer import generate
from exitlm.model import layers
from exitlm.model.layers import Block, Linear


def _model(dtype: torch.dtype = torch.float32, **exit_kw: object) -> EarlyExitLM:
    cfg = preset("debug", exits=ExitConfig(**exit_kw))  # type: ignore[arg-type]
    return EarlyExitLM(cfg).eval().to(dtype)


def test_state_dict_keys_and_tensors_stay_the_same() -> None:
    model = _model(layers=(1,), output="own")
    before = model.state_dict()
    params = dict(model.named_parameters())
    values = {k: v.clone() for k, v in before.items()}
    prepare_for_decoding(model, pack_rows=True)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in after.items():
        assert torch.equal(v, values[k]), k
    for k, p in model.named_parameters():
        assert p is params[k], k  # the same Parameter objects, re-strided at most
    # column-major re-striding shares no storage with the old layout; row-major weights
    # keep theirs
    narrow = model.layers[0].attn.wo.weight
    assert narrow.data_ptr() == before["layers.0.attn.wo.weight"].data_ptr()
    assert all(type(m) is not Linear for m in model.modules())
    assert all(type(m) is not Block for m in model.modules())
    assert type(model.layers[0].attn.wqkv) is FastLinear
    assert type(model.layers[0]) is LeanBlock or not cpu.BLAS.enabled


def test_idempotent_and_cheap_the_second_time() -> None:
    model = _model()
    prepare_for_decoding(model)
    backend = model._decoding_backend
    packs = [m.pack for m in model.modules() if isinstance(m, FastLinear)]
    assert is_prepared(model) and not is_prepared(model, pack_rows=True)
    prepare_for_decoding(model)
    assert model._decoding_backend is backend  # nothing redone
    prepare_for_decoding(model, pack_rows=True)  # asks for more: packs fp32 copies
    assert is_prepared(model, pack_rows=True) and is_prepared(model)
    assert model._decoding_backend is not backend
    assert packs == [None] * len(packs)
    if torch.backends.mkldnn.is_available():
        assert all(m.pack is not None for m in model.modules() if isinstance(m, FastLinear))
    prepare_for_decoding(model)  # asks for less: keeps what it has
    assert model._decoding_backend.pack_rows
    model.half()  # cast since: prepared again (fp16 weights must be row-major)
    assert not is_prepared(model)
    prepare_for_decoding(model)
    assert model.layers[0].attn.wqkv.weight.is_contiguous()
    # the torch lean step is fp32 only; the native block also takes fp16 weights
    assert type(model.layers[0]) is (LeanBlock if native.available() else Block)


def test_project_is_replaced_unless_a_parallel_layout_did() -> None:
    model = prepare_for_decoding(_model())
    assert model.__dict__["project"] == model._decoding_backend.project

    def mine(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return h @ weight.t()

    other = _model()
    other.project = mine  # type: ignore[method-assign]
    prepare_for_decoding(other)
    assert other.project is mine


def test_greedy_tokens_equal_the_plain_model() -> None:
    prompt = [5, 17, 42, 7]
    for dtype in (torch.float32, torch.bfloat16):
        plain = _model(dtype, layers=(1,))
        fast = copy.deepcopy(plain)
        ref = _greedy(plain, prompt)
        prepare_for_decoding(fast)
        assert _greedy(fast, prompt) == ref
        backend = fast._decoding_backend
        # the engine (lean step, cache) agrees, and leaves the prepared model alone
        res = generate(fast, None, [prompt], max_new_tokens=12, threads=1)
        assert res.token_ids[0] == ref and fast._decoding_backend is backend
        # generate() prepares an unprepared model itself, once
        assert not is_prepared(plain)
        assert generate(plain, None, [prompt], max_new_tokens=12, threads=1).token_ids[0] == ref
        assert is_prepared(plain)


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


def test_training_a_prepared_model_gives_the_same_gradients() -> None:
    plain = _model(layers=(1,))
    fast = copy.deepcopy(plain)
    prepare_for_decoding(fast, pack_rows=True)
    tokens = torch.randint(0, 256, (2, 9))
    grads = []
    for m in (plain, fast):
        m.train()
        out = m(tokens)
        loss = out.logits.float().logsumexp(-1).mean() + out.exit_logits[1].float().mean()
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
    # an optimizer step changes weights in place: inference then uses the new values
    with torch.no_grad():
        for m in (plain, fast):
            for p in m.parameters():
                p.sub_(0.1 * p.grad if p.grad is not None else 0)
        plain.eval(), fast.eval()
        torch.testing.assert_close(fast(tokens[:, :3]).logits, plain(tokens[:, :3]).logits)


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
    assert {n.split(".")[0] for n in names} <= {"__future__", "math", "torch", "exitlm"}
