"""EE-LLM / Megatron-LM checkpoints: every TP x PP split merges back to the original tensors,
exitlm's final and exit logits equal Megatron's forward on the unsharded model, ``exitlm
convert --to hf`` gives a directory transformers loads with the same logits, and a pickle
that would run code is refused without running it."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from _megatron import Spec, full_model, reference_logits, write_checkpoint

from exitlm.cli import main
from exitlm.io import CheckpointError, load_model
from exitlm.io.megatron_layout import find_shards, merge, read_shard, split_kind

SPLITS = [(1, 1), (2, 1), (1, 4), (2, 2)]
TOKENS = torch.tensor([[3, 17, 5, 60, 11, 2, 9, 44], [8, 1, 30, 7, 7, 19, 55, 0]])

LLAMA = Spec()  # RMSNorm, rope, SwiGLU, GQA, tied, exits on layers 2, 3 with --pre-exit
RELEASE_7B = Spec(untie_embeddings_and_output_weights=True, untie_exit_output_weights=True,
                  num_query_groups=None)  # the 7B release's flags (exits untied, MHA)
HEADS = Spec(use_exit_block=True, use_exit_norm=True, untie_exit_output_weights=True,
             pre_exit=False, exit_layer_nums=[1, 3])
BIASED = Spec(add_bias_linear=True)  # Llama with attention_bias and mlp_bias
GPT = Spec(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
           add_bias_linear=True, num_query_groups=None, ffn_hidden_size=64)


def _ckpt(tmp_path: Path, spec: Spec, tp: int, pp: int) -> tuple[Path, dict[str, torch.Tensor]]:
    full = full_model(spec, tp)
    return write_checkpoint(tmp_path / f"mg{tp}x{pp}", spec, full, tp, pp), full


def _check_logits(model: torch.nn.Module, spec: Spec, full: dict[str, torch.Tensor]) -> None:
    want, want_exits = reference_logits(spec, full, TOKENS)
    with torch.no_grad():
        out = model(TOKENS)
    torch.testing.assert_close(out.logits, want, atol=2e-5, rtol=1e-4)
    assert sorted(out.exit_logits) == sorted(want_exits)
    for layer, logits in want_exits.items():
        torch.testing.assert_close(out.exit_logits[layer], logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("tp", "pp"), SPLITS)
def test_shards_merge_back_to_the_original(tmp_path: Path, tp: int, pp: int) -> None:
    root, full = _ckpt(tmp_path, LLAMA, tp, pp)
    shards = find_shards(root)
    assert (shards.tp, shards.pp) == (tp, pp)
    lp = LLAMA.num_layers // pp
    merged: dict[str, torch.Tensor] = {}
    for p in range(pp):
        parts = [read_shard(shards.file(t, p)).tensors for t in range(tp)]
        for key in parts[0]:
            if key.startswith("word_embeddings_for_head"):
                continue
            name = key
            if key.startswith("encoder.layers."):
                i = int(key.split(".")[2]) + p * lp
                name = f"encoder.layers.{i}.{key.split('.', 3)[3]}"
            merged[name] = merge(split_kind(key, LLAMA.swiglu), [d[key] for d in parts])
    assert merged.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name


@pytest.mark.parametrize(("tp", "pp"), SPLITS)
@pytest.mark.parametrize("spec", [LLAMA, HEADS], ids=["llama", "block-heads"])
def test_logits_equal_megatron_forward(tmp_path: Path, spec: Spec, tp: int, pp: int) -> None:
    root, full = _ckpt(tmp_path, spec, tp, pp)
    loaded = load_model(str(root))
    cfg = loaded.config
    assert cfg.vocab_size == spec.vocab_size and cfg.num_layers == spec.num_layers
    assert cfg.exits.layers == tuple(n - spec.pre_exit for n in spec.exit_layer_nums)
    _check_logits(loaded.model, spec, full)


@pytest.mark.parametrize("spec", [RELEASE_7B, GPT], ids=["release-7b-flags", "gpt2-style"])
def test_other_architectures(tmp_path: Path, spec: Spec) -> None:
    root, full = _ckpt(tmp_path, spec, 2, 2)
    _check_logits(load_model(str(root)).model, spec, full)


@pytest.mark.parametrize("spec", [LLAMA, BIASED, GPT], ids=["llama", "biased", "gpt2-style"])
def test_convert_to_hf_loads_in_transformers(tmp_path: Path, spec: Spec) -> None:
    transformers = pytest.importorskip("transformers")
    root, full = _ckpt(tmp_path, spec, 2, 2)
    out = tmp_path / "hf"
    assert main(["convert", str(root), str(out), "--to", "hf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == ("LlamaForCausalLM" if spec.swiglu else "GPT2LMHeadModel")
    want, want_exits = reference_logits(spec, full, TOKENS)
    with torch.no_grad():
        got = hf(TOKENS).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    _check_logits(load_model(str(out)).model, spec, full)  # exits stored beside it
    assert sorted(load_model(str(out)).config.exits.layers) == sorted(want_exits)


def test_convert_to_exitlm_format(tmp_path: Path) -> None:
    root, full = _ckpt(tmp_path, HEADS, 1, 4)
    assert main(["convert", str(root), str(tmp_path / "ex")]) == 0
    _check_logits(load_model(str(tmp_path / "ex")).model, HEADS, full)


class _Evil:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.canary}",))


def test_malicious_shard_is_refused_without_running(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = _ckpt(tmp_path, LLAMA, 2, 2)
    canary = tmp_path / "canary"
    shard = root / "iter_0000100" / "mp_rank_01_001" / "model_optim_rng.pt"
    obj = _load_trusted(shard)
    obj["args"].payload = _Evil(canary)
    torch.save(obj, shard)
    with pytest.raises(CheckpointError, match=r"(posix|os)\.system"):
        load_model(str(root))
    assert main(["convert", str(root), str(tmp_path / "out"), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_01_001" in err and "system" in err and "Traceback" not in err
    assert not canary.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"hello world\n", b"", b"PK\x03\x04 not a zip"])
def test_a_shard_that_is_not_a_torch_file_is_one_line(tmp_path: Path, content: bytes,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Text where a shard should be made torch's safe unpickler raise an IndexError."""
    root, _ = _ckpt(tmp_path, LLAMA, 2, 2)
    shard = root / "iter_0000100" / "mp_rank_01_001" / "model_optim_rng.pt"
    shard.write_bytes(content)
    assert main(["info", str(root)]) == 2
    err = capsys.readouterr().err
    assert "mp_rank_01_001" in err and "Traceback" not in err and len(err.splitlines()) <= 2


def test_unsupported_option_is_refused_in_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = _ckpt(tmp_path, LLAMA, 1, 1)
    shard = root / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt"
    obj = _load_trusted(shard)
    obj["args"].use_exit_mlp = True
    torch.save(obj, shard)
    assert main(["info", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--use-exit-mlp" in err[0] and "model_optim_rng.pt" in err[0]


def _load_trusted(path: Path) -> dict[str, object]:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)


def test_pre_exit_at_layer_one_is_refused(tmp_path: Path) -> None:
    spec = dataclasses.replace(LLAMA, exit_layer_nums=[1, 3])
    root, _ = _ckpt(tmp_path, spec, 1, 1)
    with pytest.raises(CheckpointError, match="--exit-layer-nums 1 with --pre-exit"):
        load_model(str(root))


def test_to_hf_refuses_a_model_no_hf_architecture_computes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = dataclasses.replace(LLAMA, normalization="LayerNorm")  # rotary + LayerNorm
    root, full = _ckpt(tmp_path, spec, 2, 1)
    _check_logits(load_model(str(root)).model, spec, full)  # exitlm computes it
    assert main(["convert", str(root), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "RMSNorm" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("spec", [LLAMA, HEADS, GPT], ids=["llama", "block-heads", "gpt2-style"])
def test_resharding_round_trip_is_bit_identical(tmp_path: Path, spec: Spec) -> None:
    root, full = _ckpt(tmp_path, spec, 2, 2)
    a = load_model(str(root)).model.state_dict()
    assert main(["convert", str(root), str(tmp_path / "b"), "--to", "megatron", "--pp", "4"]) == 0
    assert find_shards(tmp_path / "b").tp == 1 and find_shards(tmp_path / "b").pp == 4
    assert main(["convert", str(tmp_path / "b"), str(tmp_path / "c"), "--to", "megatron",
                 "--tp", "2", "--pp", "2"]) == 0
    for d in ("b", "c"):
        loaded = load_model(str(tmp_path / d))
        got = loaded.model.state_dict()
        assert got.keys() == a.keys()
        assert all(torch.equal(got[k], a[k]) for k in a), d
    _check_logits(load_model(str(tmp_path / "c")).model, spec, full)


def test_written_shards_follow_the_reference_layout(tmp_path: Path) -> None:
    """Same file names, nesting and tensors per shard as the reference writer (vocabulary
    tensors aside: exitlm pads to a multiple of 128 x TP, the synthetic writer to 8 x TP)."""
    root, _ = _ckpt(tmp_path, RELEASE_7B, 2, 2)
    assert main(["convert", str(root), str(tmp_path / "c"), "--to", "megatron", "--tp", "2",
                 "--pp", "2"]) == 0
    ref, ours = find_shards(root), find_shards(tmp_path / "c")
    for t in range(2):
        for p in range(2):
            assert ref.file(t, p).parent.name == ours.file(t, p).parent.name
            a, b = read_shard(ref.file(t, p)), read_shard(ours.file(t, p))
            assert a.tensors.keys() == b.tensors.keys()
            for k, v in a.tensors.items():
                if "word_embeddings" not in k and "output_layer" not in k:
                    assert torch.equal(v, b.tensors[k]), k
