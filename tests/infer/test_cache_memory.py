"""No memory growth per generated token beyond the preallocated KV cache: every strategy keeps
a constant number of live tensors (and bytes) from one token to the next."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from _ee_models import ee_model, one_thread, random_prompts  # noqa: F401

from exitlm.infer import autoregressive, common, generate

pytestmark = pytest.mark.usefixtures("one_thread")


def _live_tensors() -> tuple[int, int]:
    """Live tensors and their bytes; boolean attention masks are left out of the bytes: they
    are rebuilt every step with one entry per attended slot, like the attention scores."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return len(ts), sum(t.untyped_storage().nbytes() for t in ts if t.dtype != torch.bool)


@pytest.mark.parametrize(
    ("strategy", "opts", "batch"),
    [
        ("ar", {}, 2),
        ("early-exit", {"threshold": 0.3, "max_pending": 4}, 2),
        ("early-exit", {"exit_layer": 2}, 2),
        ("self-spec", {"exit_layer": 2, "num_speculations": 3}, 2),
        ("ppd", {"ppd_layer": 3, "ppd_k": 2}, 1),
    ],
)
def test_no_growth_per_token(strategy: str, opts: dict, batch: int, monkeypatch) -> None:
    gc.collect()  # later samples rely on reference counting alone (collections are slow)
    model = ee_model(every_layer=True)
    prompts = random_prompts(sizes=(5, 8)[:batch])
    samples: list[tuple[int, int]] = []
    calls = [0]
    every = 1 if strategy == "self-spec" else 3  # gc scans are slow; sample every few tokens

    def sample() -> None:
        calls[0] += 1
        if calls[0] % every == 0:
            samples.append(_live_tensors())

    orig = common.Session.push

    def push(self: common.Session, i: int, tokens: list[int], layers: list[int]) -> int:
        if i == 0:
            sample()
        return orig(self, i, tokens, layers)

    monkeypatch.setattr(common.Session, "push", push)
    orig_record = autoregressive._record

    def record(*args: object) -> int:
        sample()
        return orig_record(*args)

    monkeypatch.setattr(autoregressive, "_record", record)
    out = generate(model, None, prompts, strategy=strategy, max_new_tokens=30, ignore_eos=True,
                   **opts)
    assert len(out.token_ids[0]) == 30
    steady = samples[2:-2]  # the last rounds draft / fork less (fewer tokens left)
    assert len(steady) >= 3
    assert max(n for n, _ in steady) == min(n for n, _ in steady), steady
    assert max(b for _, b in steady) == min(b for _, b in steady), steady
