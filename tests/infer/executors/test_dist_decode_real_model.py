"""Decoding across processes on the embedded SmolLM2-135M with tuned exits (``default-ee``):
pipeline-based early exit gives KV recomputation's tokens, TP=2 (3 key/value heads split
1 + 2, shared-memory sums) and TP=3 give one process's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _default_model import requires_default_model
from exitlm.infer import generate
from exitlm.infer.executors.tp import TPExecutor

pytestmark = [pytest.mark.real_model, pytest.mark.slow, requires_default_model]

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def loaded() -> Any:
    from exitlm.io import load_model

    return load_model("default-ee")


def test_pipeline_and_tp_on_smollm2(loaded: Any) -> None:
    torch.set_num_threads(1)
    kw = {"strategy": "early-exit", "threshold": 0.5, "max_new_tokens": 12,
          "ignore_eos": True, "threads": 1}
    with torch.inference_mode():
        ref = generate(loaded.model, loaded.tokenizer, PROMPT, **kw).sequences[0]
        pipe = generate(loaded.model, loaded.tokenizer, PROMPT, kv="pipeline", stages=2,
                        **kw).sequences[0]
    assert (pipe.token_ids, pipe.exit_layers) == (ref.token_ids, ref.exit_layers)
    assert any(x < loaded.model.num_layers for x in ref.exit_layers)
    for tp in (2, 3):
        with TPExecutor(loaded.model, tp) as ranks:
            got = generate(ranks, loaded.tokenizer, PROMPT, **kw).sequences[0]
        assert (got.token_ids, got.exit_layers) == (ref.token_ids, ref.exit_layers), tp
