"""Greedy decoding of the embedded SmolLM2-135M equals transformers' on the same weights."""

from __future__ import annotations

import pytest
import torch

from _default_model import requires_default_model

pytestmark = [pytest.mark.real_model, requires_default_model]

transformers = pytest.importorskip("transformers")
exitlm_io = pytest.importorskip("exitlm.io")
if not hasattr(exitlm_io, "load_model"):
    pytest.skip("exitlm.io.load_model is not available", allow_module_level=True)

from exitlm.infer import generate  # noqa: E402

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, a small robot"]
NEW = 20


@pytest.fixture(scope="module")
def models() -> tuple:
    from exitlm.io.default_model import default_gguf_path

    loaded = exitlm_io.load_model("default")
    gguf = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    return loaded, hf


def _hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], new: int = NEW
               ) -> list[list[int]]:
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # transformers batches with left padding
        ids[i, t - len(p):] = torch.tensor(p)
        mask[i, t - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                          eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                          top_k=None)
    return out[:, t:].tolist()


def test_greedy_single_prompt_matches_transformers(models: tuple) -> None:
    loaded, hf = models
    ids = loaded.tokenizer.encode(PROMPTS[0])
    got = generate(loaded.model, loaded.tokenizer, PROMPTS[0], max_new_tokens=NEW,
                   ignore_eos=True)
    assert got.token_ids[0] == _hf_greedy(hf, [ids])[0]
    assert "Paris" in got.text


def test_greedy_steps_through_the_screened_head_match_transformers(models: tuple) -> None:
    """Long enough for the int8 screen of the fp32 head (kernels/screen.py) to be made: the
    tokens stay the fp32 head's, those of transformers."""
    from exitlm.kernels import native, screen
    from exitlm.runtime import native as native_runner

    loaded, hf = models
    new = screen.BUILD_TOKENS + 8
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    got = generate(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=new,
                   ignore_eos=True)
    weight = loaded.model.output_embedding()
    if native.library() is not None:  # the native runner screened the steps
        assert native_runner._screen_of(weight, make=False) is not None
    assert got.token_ids == _hf_greedy(hf, ids, new)


def test_greedy_padded_batch_matches_transformers(models: tuple) -> None:
    loaded, hf = models
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(x) for x in ids}) > 1  # really ragged
    got = generate(loaded.model, loaded.tokenizer, PROMPTS, max_new_tokens=NEW,
                   ignore_eos=True)
    assert got.token_ids == _hf_greedy(hf, ids)
