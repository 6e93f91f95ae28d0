"""Greedy decode speed of exitlm vs llama.cpp (llama-cpp-python) on the same weights.

Both libraries read the same GGUF file for each precision, made from the embedded
SmolLM2-135M-Instruct GGUF (Q8_0 embedding, Q4_1 elsewhere): every tensor is dequantized to
fp32 and written to a new GGUF with the same metadata and names (``write_f32_gguf``), and
llama.cpp's own quantizer turns that file into F16, Q8_0, Q4_0 and Q4_1 (``pure``: every
matrix in the requested type, no Q6_K output head). The files are cached under
``$EXITLM_CACHE`` (or ``~/.cache/exitlm``) in ``bench-gguf/``, keyed by the source file's
size and mtime.

Precisions: ``fp32`` (F32 file, exitlm ``torch.float32``), ``fp16`` (F16 file,
``torch.float16``), ``int8`` (Q8_0 file, exitlm ``dtype="int8"``), ``q4_0`` / ``q4_1``
(Q4_0 / Q4_1 files, exitlm ``dtype="int4"``). A precision exitlm cannot load is reported as
``{"unsupported": message}`` on its side and the run goes on.

Method: the same prompt token ids on both sides, greedy, exactly N new tokens (EOS ignored;
llama-cpp-python's ``generate`` never stops on EOS by itself), the same thread count
(``torch.set_num_threads`` / llama.cpp ``n_threads``), one warm-up per model, ``--repeats``
runs per prompt alternating the libraries so that background load hits both. Decode tokens/s
counts the tokens after the first over the time after the first token. The fastest run of
each prompt is summed into ``decode_tokens_per_s`` (and the median run into
``decode_tokens_per_s_median``). ``bandwidth_gb_s`` is the file's size times tokens/s (each
decoded token streams all weights once; the tied embedding is the LM head).

``--layerskip DIR`` adds the self-speculative comparison: a byte-level LayerSkip checkpoint
(the shipped ``src/exitlm/data/layerskip_code``, ``runs/scratch-layerskip/model``) is written
as a llama GGUF (``write_byte_level_gguf``) and quantized to Q8_0 by llama.cpp; exitlm's
self-speculative decoding (draft exit ``--exit-layer``, or chosen while decoding from the
model's recorded round) in int8 and fp32 runs against llama.cpp's plain decoding of Q8_0 and
F32.

llama-cpp-python is a benchmark-only extra (``pip install 'exitlm[bench]'``), not a
dependency of the package. Prints one JSON object on stdout; progress goes to stderr.

    python benchmarks/decode_vs_llamacpp.py                     # all precisions, 1 thread
    python benchmarks/decode_vs_llamacpp.py --quick             # one prompt, 16 tokens
    python benchmarks/decode_vs_llamacpp.py --precisions fp32,int8 --repeats 3
    python benchmarks/decode_vs_llamacpp.py --layerskip runs/scratch-layerskip/model
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _bench import machine, note
from exitlm.args import int_at_least

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


@dataclass(frozen=True)
class Precision:
    file: str  # key of the GGUF file (bench_files)
    exitlm_dtype: Any  # what load_model gets
    target: float | None  # exitlm / llama.cpp decode ratio to reach


PRECISIONS = {  # the target of every precision: at least llama.cpp's speed (issue 34)
    "fp32": Precision("f32", torch.float32, 1.0),
    "fp16": Precision("f16", torch.float16, 1.0),
    "int8": Precision("q8_0", "int8", 1.0),
    "q4_0": Precision("q4_0", "int4", 1.0),
    "q4_1": Precision("q4_1", "int4", 1.0),
}
# llama.cpp ftype constant names (llama_cpp.LLAMA_FTYPE_*) of the quantized files
QUANTIZED = {"f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
             "q4_1": "MOSTLY_Q4_1"}


# ---------------------------------------------------------------- the GGUF files


def write_f32_gguf(src: str | Path, dst: str | Path) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with every tensor dequantized to float32.

    Metadata (hyperparameters, tokenizer, chat template, ...) and tensor names and order are
    kept, and so is llama.cpp's permuted row order of ``attn_q``/``attn_k`` (it is
    llama.cpp's own layout); ``general.file_type`` becomes ALL_F32. Written to a temporary
    file and renamed into place.
    """
    import gguf

    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the writer writes these itself
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if key == "general.file_type":
                value = int(gguf.LlamaFileType.ALL_F32)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        if "general.file_type" not in reader.fields:
            writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the fastest dim first
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C libraries' logs) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def quantize_gguf(src: Path, dst: Path, kind: str, threads: int) -> Path:
    """llama.cpp's own quantizer: ``src`` (F32) to ``dst`` in ``kind`` (a QUANTIZED key)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{QUANTIZED[kind]}")
    params.nthread = threads
    params.pure = True  # every matrix in the requested type (no Q6_K output / embedding)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with _quiet_stderr():  # the quantizer logs a line per tensor
            rc = llama_cpp.llama_model_quantize(
                str(src).encode(), str(tmp).encode(), ctypes.byref(params)
            )
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({kind}) returned {rc}")
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


def cache_dir() -> Path:
    root = os.environ.get("EXITLM_CACHE") or Path.home() / ".cache" / "exitlm"
    return Path(root) / "bench-gguf"


def bench_files(src: Path, kinds: list[str], threads: int = 2) -> dict[str, Path]:
    """The GGUF files of ``kinds`` (``f32`` and QUANTIZED keys) made from ``src``, cached."""
    st = src.stat()
    folder = cache_dir() / f"{src.stem}-{st.st_size}-{int(st.st_mtime)}"
    folder.mkdir(parents=True, exist_ok=True)
    f32 = folder / f"{src.stem}.f32.gguf"
    if not f32.exists():
        note(f"writing {f32} (every tensor dequantized to fp32) ...")
        write_f32_gguf(src, f32)
    out = {"f32": f32}
    for kind in kinds:
        if kind == "f32":
            continue
        path = folder / f"{src.stem}.{kind}.gguf"
        if not path.exists():
            note(f"quantizing to {kind} with llama.cpp ...")
            quantize_gguf(f32, path, kind, threads)
        out[kind] = path
    return out


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file holds."""
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight":
               "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight":
               "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def _permute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (exitlm's GGUF loader undoes it)."""
    half = w.shape[0] // n_heads // 2
    x = w.reshape(n_heads, 2, half, *w.shape[1:])
    return np.ascontiguousarray(x.swapaxes(1, 2)).reshape(w.shape)


def write_byte_level_gguf(model_dir: str | Path, dst: str | Path) -> Path:
    """An F32 llama GGUF of a byte-level exitlm checkpoint (a stock Llama-family backbone,
    vocabulary of 256 bytes, id = byte value) that llama.cpp can run.

    The vocabulary is a GPT-2-style byte-level BPE of the 256 byte characters with one merge
    that never applies (llama.cpp requires the key; GGUF forbids empty arrays). Exit heads
    are not written: this is for plain decoding of the full model (with shared final-head
    exits, ``load_model(dst, exits=ExitConfig(every_layer=True))`` gives exitlm the same
    exits back).
    """
    import gguf

    from exitlm.io import load_model
    from exitlm.io.hf_map import exitlm_to_hf
    from exitlm.tokenizer import byte_level_alphabet

    loaded = load_model(str(model_dir), dtype=torch.float32)
    cfg = loaded.config
    if cfg.vocab_size != 256 or cfg.norm != "rmsnorm" or cfg.pos != "rope" or cfg.qkv_bias:
        raise ValueError(f"{model_dir}: not a byte-level Llama-family model")
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    try:
        w.add_name(Path(model_dir).name)
        w.add_block_count(cfg.num_layers)
        w.add_context_length(cfg.max_seq_len)
        w.add_embedding_length(cfg.dim)
        w.add_feed_forward_length(cfg.hidden_dim)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.n_kv_heads)
        w.add_rope_dimension_count(cfg.hdim)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_vocab_size(cfg.vocab_size)
        w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        alpha = byte_level_alphabet()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([alpha[b] for b in range(256)])
        w.add_token_types([int(gguf.TokenType.NORMAL)] * 256)
        w.add_token_merges([f"{alpha[0]} {alpha[0]}"])
        w.add_add_bos_token(False)
        written = set()
        for hf, t in exitlm_to_hf(loaded.model.state_dict().items(), cfg):
            if hf in _GGUF_NAMES:
                name = _GGUF_NAMES[hf]
            else:
                _, _, i, rest = hf.split(".", 3)
                name = f"blk.{i}.{_GGUF_LAYER[rest]}"
            if name in written:
                continue
            arr = t.detach().float().numpy().copy()
            if name.endswith("attn_q.weight"):
                arr = _permute_rotary_rows(arr, cfg.num_heads)
            elif name.endswith("attn_k.weight"):
                arr = _permute_rotary_rows(arr, cfg.n_kv_heads)
            w.add_tensor(name, arr)
            written.add(name)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


def layerskip_files(model_dir: Path) -> dict[str, Path]:
    """F32 and Q8_0 GGUFs of a byte-level exitlm checkpoint, cached like bench_files."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{model_dir}: no *.safetensors")
    st = weights[0].stat()
    name = "-".join(model_dir.resolve().parts[-2:])  # runs/NAME/model -> NAME-model
    folder = cache_dir() / f"{name}-{st.st_size}-{int(st.st_mtime)}"
    folder.mkdir(parents=True, exist_ok=True)
    f32, q8 = folder / f"{name}.f32.gguf", folder / f"{name}.q8_0.gguf"
    if not f32.exists():
        note(f"writing {f32} ...")
        write_byte_level_gguf(model_dir, f32)
    if not q8.exists():
        note("quantizing it to q8_0 with llama.cpp ...")
        quantize_gguf(f32, q8, "q8_0", 2)
    return {"f32": f32, "q8_0": q8}


# ---------------------------------------------------------------- the two libraries


def run_llamacpp(llm: Any, ids: list[int], new: int) -> dict[str, Any]:
    """One greedy llama.cpp generation of exactly ``new`` tokens."""
    llm.reset()  # no KV prefix reuse: the prompt is evaluated every time
    tokens: list[int] = []
    t0 = time.perf_counter()
    first = t0
    for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        if len(tokens) == 1:
            first = time.perf_counter()
        if len(tokens) == new:
            break
    t_end = time.perf_counter()
    return {"tokens": tokens, "prefill_s": first - t0, "decode_s": t_end - first,
            "decode_tokens": len(tokens) - 1}


def run_exitlm(model: torch.nn.Module, ids: list[int], new: int, threads: int) -> dict[str, Any]:
    from exitlm.infer import generate

    res = generate(model, None, ids, max_new_tokens=new, ignore_eos=True, threads=threads)
    tm = res.timings
    return {"tokens": list(res.token_ids[0]), "prefill_s": tm.prefill_s,
            "decode_s": tm.decode_s, "decode_tokens": tm.decode_tokens}


def _rate(r: dict[str, Any]) -> float:
    return r["decode_tokens"] / r["decode_s"] if r["decode_s"] > 0 else 0.0


def _summary(best: list[dict[str, Any]], median: list[dict[str, Any]], size: int) -> dict:
    rate = sum(r["decode_tokens"] for r in best) / sum(r["decode_s"] for r in best)
    med = sum(r["decode_tokens"] for r in median) / sum(r["decode_s"] for r in median)
    return {
        "decode_tokens_per_s": rate,
        "decode_tokens_per_s_median": med,
        "prefill_s_mean": sum(r["prefill_s"] for r in best) / len(best),
        "bandwidth_gb_s": size * rate / 1e9,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = sorted(runs, key=_rate)
    return rates[(len(rates) - 1) // 2]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    return diff


def load_exitlm(path: Path, dtype: Any) -> tuple[torch.nn.Module | None, str | None]:
    """exitlm's model from ``path`` in ``dtype``, or (None, why) when it cannot load it."""
    from exitlm.errors import ConfigError
    from exitlm.io import load_model

    try:
        return load_model(str(path), dtype=dtype).model, None
    except (TypeError, ValueError, ConfigError, NotImplementedError) as e:
        return None, f"{type(e).__name__}: {e}"
    except RuntimeError as e:
        if not isinstance(dtype, str):  # a string dtype the loader does not know yet ends
            raise  # up in Tensor.to(), which raises RuntimeError; anything else is a bug
        return None, f"{type(e).__name__}: {e}"


def bench_precision(
    name: str, files: dict[str, Path], prompt_ids: list[list[int]], prompts: list[str],
    new: int, repeats: int, threads: int,
) -> dict[str, Any]:
    from llama_cpp import Llama

    prec = PRECISIONS[name]
    path = files[prec.file]
    size = path.stat().st_size
    n_ctx = max(len(i) for i in prompt_ids) + new + 16
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                n_ctx=max(256, n_ctx), verbose=False)
    llama_ids = [llm.tokenize(p.encode(), add_bos=False, special=False) for p in prompts]
    out: dict[str, Any] = {
        "file": path.name, "file_bytes": size, "tensor_types": tensor_types(path),
        "exitlm_dtype": str(prec.exitlm_dtype).replace("torch.", ""), "target": prec.target,
        "tokenizers_agree": llama_ids == prompt_ids,
    }
    ours, why = load_exitlm(path, prec.exitlm_dtype)
    run_llamacpp(llm, prompt_ids[0], 4)  # warm-up
    if ours is not None:
        run_exitlm(ours, prompt_ids[0], 4, threads)  # warm-up (also lays out the weights)
    rows, mine_best, mine_med, theirs_best, theirs_med = [], [], [], [], []
    for prompt, ids in zip(prompts, prompt_ids, strict=True):
        a_runs, b_runs = [], []
        for _ in range(repeats):  # alternate the libraries so background load hits both
            if ours is not None:
                a_runs.append(run_exitlm(ours, ids, new, threads))
            b_runs.append(run_llamacpp(llm, ids, new))
        b = max(b_runs, key=_rate)
        theirs_best.append(b)
        theirs_med.append(_median_run(b_runs))
        row: dict[str, Any] = {"prompt": prompt, "prompt_tokens": len(ids),
                               "llamacpp_decode_tokens_per_s": _rate(b)}
        if a_runs:
            a = max(a_runs, key=_rate)
            mine_best.append(a)
            mine_med.append(_median_run(a_runs))
            row["exitlm_decode_tokens_per_s"] = _rate(a)
            row["identical"] = a["tokens"] == b["tokens"]
            row["first_difference"] = _first_difference(a["tokens"], b["tokens"])
            note(f"{name}: exitlm {_rate(a):.1f} vs llama.cpp {_rate(b):.1f} tok/s, "
                 f"identical={row['identical']}")
        else:
            note(f"{name}: exitlm unsupported; llama.cpp {_rate(b):.1f} tok/s")
        rows.append(row)
    out["llamacpp"] = _summary(theirs_best, theirs_med, size)
    if ours is None:
        out["exitlm"] = {"unsupported": why}
    else:
        out["exitlm"] = _summary(mine_best, mine_med, size)
        ratio = out["exitlm"]["decode_tokens_per_s"] / out["llamacpp"]["decode_tokens_per_s"]
        out["ratio"] = ratio
        out["ratio_median"] = (out["exitlm"]["decode_tokens_per_s_median"]
                               / out["llamacpp"]["decode_tokens_per_s_median"])
        out["target_met"] = None if prec.target is None else ratio >= prec.target
        out["all_identical"] = all(r["identical"] for r in rows)
    out["prompts"] = rows
    del llm
    return out


LAYERSKIP_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\n",
    "class Stack:\n    def __init__(self):\n        ",
]


def run_self_spec(model: torch.nn.Module, ids: list[int], new: int, threads: int,
                  exit_layer: int | None) -> dict[str, Any]:
    from exitlm.infer import generate

    chosen = {} if exit_layer is None else {"exit_layer": exit_layer}
    res = generate(model, None, ids, strategy="self-spec", max_new_tokens=new,
                   ignore_eos=True, threads=threads, **chosen)
    tm = res.timings
    return {"tokens": list(res.token_ids[0]), "prefill_s": tm.prefill_s,
            "decode_s": tm.decode_s, "decode_tokens": tm.decode_tokens}


def bench_layerskip(model_dir: Path, exit_layer: int | None, new: int, repeats: int,
                    threads: int, prompts: list[str]) -> dict[str, Any]:
    """exitlm's self-speculative decoding of a byte-level LayerSkip model against llama.cpp's
    plain decoding of the same weights: int8 vs Q8_0 (the target: faster) and, for
    reference, fp32 vs F32. llama.cpp reads the GGUF files of write_byte_level_gguf; exitlm
    reads the checkpoint (identical fp32 weights; in int8, exitlm's own quantization of
    them, so the int8 weights are not bit-identical to llama.cpp's Q8_0, whose quantizer
    also keeps tensors with rows not a multiple of 32 in F16)."""
    from llama_cpp import Llama

    from exitlm.io import load_model

    files = layerskip_files(model_dir)
    prompt_ids = [list(p.encode()) for p in prompts]  # byte-level: id = byte value
    out: dict[str, Any] = {"model": str(model_dir),
                           "exit_layer": "adaptive" if exit_layer is None else exit_layer,
                           "strategy": "exitlm self-spec vs llama.cpp plain greedy"}
    for label, kind, dtype, target in (("int8", "q8_0", "int8", 1.0),
                                       ("fp32", "f32", torch.float32, None)):
        path = files[kind]
        llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads,
                    n_ctx=256, verbose=False)
        res: dict[str, Any] = {"file": path.name, "file_bytes": path.stat().st_size,
                               "exitlm_weights": f"{model_dir} loaded with dtype {dtype}",
                               "tensor_types": tensor_types(path), "target": target}
        try:
            # exitlm reads the checkpoint itself (the fp32 weights the GGUF was written
            # from): its GGUF tokenizer builder cannot take the placeholder merge
            ours = load_model(str(model_dir), dtype=dtype).model
            why = None
        except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not isinstance(dtype, str):
                raise
            ours, why = None, f"{type(e).__name__}: {e}"
        run_llamacpp(llm, prompt_ids[0], 4)
        if ours is not None:
            run_self_spec(ours, prompt_ids[0], 4, threads, exit_layer)
        a_best, a_med, b_best, b_med, rows = [], [], [], [], []
        for prompt, ids in zip(prompts, prompt_ids, strict=True):
            a_runs, b_runs = [], []
            for _ in range(repeats):
                if ours is not None:
                    a_runs.append(run_self_spec(ours, ids, new, threads, exit_layer))
                b_runs.append(run_llamacpp(llm, ids, new))
            b = max(b_runs, key=_rate)
            b_best.append(b)
            b_med.append(_median_run(b_runs))
            row: dict[str, Any] = {"prompt": prompt, "llamacpp_decode_tokens_per_s": _rate(b)}
            if a_runs:
                a = max(a_runs, key=_rate)
                a_best.append(a)
                a_med.append(_median_run(a_runs))
                row.update(exitlm_decode_tokens_per_s=_rate(a),
                           identical=a["tokens"] == b["tokens"],
                           first_difference=_first_difference(a["tokens"], b["tokens"]))
            note(f"layerskip {label}: exitlm self-spec "
                 f"{row.get('exitlm_decode_tokens_per_s', float('nan')):.1f} vs llama.cpp "
                 f"{_rate(b):.1f} tok/s")
            rows.append(row)
        size = res["file_bytes"]
        res["llamacpp"] = _summary(b_best, b_med, size)
        if ours is None:
            res["exitlm"] = {"unsupported": why}
        else:
            res["exitlm"] = _summary(a_best, a_med, size)
            ratio = res["exitlm"]["decode_tokens_per_s"] / res["llamacpp"]["decode_tokens_per_s"]
            res["ratio"] = ratio
            res["target_met"] = None if target is None else ratio > target
            res["all_identical"] = all(r["identical"] for r in rows)
        res["prompts"] = rows
        out[label] = res
        del llm
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help=f"comma-separated subset of {list(PRECISIONS)}")
    ap.add_argument("--threads", type=int, default=1, help="threads of both libraries")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per prompt and library (fastest and median are reported)")
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 new tokens, 1 run")
    ap.add_argument("--layerskip", type=Path, default=None, metavar="DIR",
                    help="also a byte-level LayerSkip checkpoint (e.g. "
                         "runs/scratch-layerskip/model): exitlm self-spec vs llama.cpp plain")
    ap.add_argument("--exit-layer", type=int_at_least(1), default=None,
                    help="self-spec draft exit (default: chosen while decoding, from the "
                         "model's recorded round when its config has one)")
    args = ap.parse_args(argv)
    names = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in names if p not in PRECISIONS]
    if unknown:
        ap.error(f"unknown precisions {unknown}; choose from {list(PRECISIONS)}")
    try:
        import llama_cpp
    except ImportError:
        ap.error("needs llama-cpp-python: pip install 'exitlm[bench]'")
    from exitlm.io import load_model
    from exitlm.io.default_model import default_gguf_path

    torch.set_num_threads(args.threads)
    prompts = PROMPTS[:1] if args.quick else PROMPTS
    new = 16 if args.quick else args.new_tokens
    repeats = 1 if args.quick else max(1, args.repeats)
    src = default_gguf_path()
    files = bench_files(src, sorted({PRECISIONS[n].file for n in names}))
    tok = load_model("default").tokenizer
    assert tok is not None
    prompt_ids = [tok.encode(p) for p in prompts]
    results = {}
    for name in names:
        note(f"{name}: {files[PRECISIONS[name].file].name}")
        results[name] = bench_precision(name, files, prompt_ids, prompts, new, repeats,
                                        args.threads)
    if args.layerskip is not None:
        results["layerskip_self_spec"] = bench_layerskip(
            args.layerskip, args.exit_layer, new, repeats, args.threads,
            LAYERSKIP_PROMPTS[: len(prompts)])
    check = None
    if "fp32" in results and "exitlm_decode_tokens_per_s" in results["fp32"]["prompts"][0]:
        rows = results["fp32"]["prompts"]
        check = {"exitlm_fp32_vs_llamacpp_f32_identical": all(r["identical"] for r in rows),
                 "first_differences": [r["first_difference"] for r in rows]}
    report = {
        "model": f"SmolLM2-135M-Instruct, from {src.name} dequantized to f32 and requantized "
                 "by llama.cpp",
        "cache": str(files["f32"].parent),
        "batch_size": 1,
        "new_tokens": new,
        "prompts": len(prompts),
        "repeats": repeats,
        "threads": args.threads,
        "llama_cpp_python": llama_cpp.__version__,
        **machine(),
        "sanity_fp32": check,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
