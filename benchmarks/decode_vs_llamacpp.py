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

llama-cpp-python is a benchmark-only extra (``pip install 'exitlm[bench]'``), not a
dependency of the package. Prints one JSON object on stdout; progress goes to stderr.

    python benchmarks/decode_vs_llamacpp.py                     # all precisions, 1 thread
    python benchmarks/decode_vs_llamacpp.py --quick             # one prompt, 16 tokens
    python benchmarks/decode_vs_llamacpp.py --precisions fp32,int8 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _bench import note

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


PRECISIONS = {
    "fp32": Precision("f32", torch.float32, 0.9),
    "fp16": Precision("f16", torch.float16, 0.9),
    "int8": Precision("q8_0", "int8", 0.8),
    "q4_0": Precision("q4_0", "int4", None),
    "q4_1": Precision("q4_1", "int4", None),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help=f"comma-separated subset of {list(PRECISIONS)}")
    ap.add_argument("--threads", type=int, default=1, help="threads of both libraries")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs per prompt and library (fastest and median are reported)")
    ap.add_argument("--quick", action="store_true", help="one prompt, 16 new tokens, 1 run")
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
        "torch": torch.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "sanity_fp32": check,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
