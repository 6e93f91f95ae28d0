"""Greedy decoding is token-identical to ``transformers``' ``generate(do_sample=False)``."""

from __future__ import annotations

import pytest
import torch

from _tiny import convert, tiny_hf
from exitlm.infer import generate

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_single_prompt_matches_transformers(kind: str) -> None:
    hf = tiny_hf(kind)
    ours = convert(hf)
    prompt = torch.randint(2, 97, (1, 7))
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                      do_sample=False)
    got = generate(ours, None, prompt[0].tolist(), max_new_tokens=24)
    assert got.token_ids[0] == ref[0, 7:].tolist()
    seq = got.sequences[0]
    assert seq.finish_reason == "length"
    assert seq.exit_layers == [ours.num_layers] * 24
    assert seq.layer_evaluations == 24 * ours.num_layers


def _hf_left_padded(hf: torch.nn.Module, prompts: list[list[int]], new: int,
                    eos: int | None) -> list[list[int]]:
    """transformers' batched greedy output (left padding + attention mask), each sequence cut
    after its first EOS."""
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p)
        mask[i, t - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                      eos_token_id=eos, pad_token_id=0)
    res = []
    for row in out[:, t:].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        res.append(row)
    return res


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_padded_batch_matches_transformers(kind: str) -> None:
    hf = tiny_hf(kind)
    ours = convert(hf)
    prompts = [torch.randint(2, 97, (n,)).tolist() for n in (5, 11, 2)]
    ref = _hf_left_padded(hf, prompts, 16, None)
    got = generate(ours, None, prompts, max_new_tokens=16)
    assert got.token_ids == ref
    # Every sequence equals its own unbatched run, too.
    for p, toks in zip(prompts, got.token_ids, strict=True):
        assert generate(ours, None, p, max_new_tokens=16).token_ids[0] == toks


def test_greedy_batch_with_eos_stops_sequences_independently() -> None:
    hf = tiny_hf("llama")
    ours = convert(hf)
    prompts = [torch.randint(2, 97, (n,)).tolist() for n in (6, 3, 9)]
    free = generate(ours, None, prompts, max_new_tokens=16).token_ids
    eos = free[0][4]  # a token the first sequence emits mid-way
    ref = _hf_left_padded(hf, prompts, 16, eos)
    got = generate(ours, None, prompts, max_new_tokens=16, stop_token_ids=(eos,))
    assert got.token_ids == ref
    assert got.sequences[0].finish_reason == "stop_token"
    assert got.token_ids[0][-1] == eos and len(got.token_ids[0]) <= 5
    for seq in got.sequences:
        assert seq.finish_reason == ("stop_token" if eos in seq.token_ids else "length")
