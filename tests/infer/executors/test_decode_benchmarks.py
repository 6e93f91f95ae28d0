"""Smoke tests of the decoding benchmarks across processes, on the random ``debug`` preset with
tiny budgets: ``benchmarks/ppd_processes.py`` (AR, thread and process PPD, Theorem 4.1) and
``benchmarks/dist_decode.py --quick`` (KV recomputation, pipeline, TP over thresholds),
``benchmarks/tp_decode.py --quick`` (TP against one process per weight format),
``benchmarks/batch_decode.py --quick`` (batches through the native blocks against torch),
``benchmarks/huge_pages.py --quick`` (weights in huge pages against 4 KiB pages),
``benchmarks/chunked_prefill.py --quick`` (a long prompt whole or in parts),
``benchmarks/shared_prefill.py --quick`` (n choices of one prompt prefilled once or each),
``benchmarks/adaptive_self_spec.py --quick --fresh 1`` (the planner of a fresh process),
``benchmarks/greedy_heads.py --quick`` (screened against whole heads per precision). They
run, print one JSON object with the documented fields, and report every method exact where
it must be. (Timings are never compared with each other.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _run(script: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_ppd_processes_quantized() -> None:
    out = _run("ppd_processes.py", "debug", "--layerskip-exits", "--ppd-layer", "2",
               "--max-new-tokens", "8", "--num-prompts", "2", "--repeats", "1",
               "--dtype", "int8", "--draft-vocab", "64")
    assert (out["d"], out["d_bar"], out["dtype"], out["draft_vocab"]) == (4, 2, "int8", 64)
    assert out["ar"]["ms_per_token"] > 0
    for name in ("ppd-thread", "ppd-process"):
        res = out[name]
        assert res["exact_match_with_ar"] is True, name
        assert 0.0 <= res["p_correct"] <= 1.0
        assert res["theorem_4_1_speedup"] >= 1.0 and res["ms_per_token"] > 0
    assert out["ppd-process"]["worker_ms_per_fork"] > 0


def test_dist_decode_quick() -> None:
    out = _run("dist_decode.py", "--quick", "--model", "debug")
    methods = {r["method"] for r in out["results"]}
    assert methods == {"recompute", "pipeline", "tp"}
    assert len(out["results"]) == 3 * 2  # two thresholds each
    for r in out["results"]:
        assert r["ms_per_token"] > 0
        if r["method"] != "recompute":  # the same tokens as one process, prompt for prompt
            assert r["same_tokens_as_recompute"] == "2/2", r
    assert out["ar_tp"]["same_tokens_as_ar"] == "2/2"


def test_tp_decode_quick() -> None:
    # one weight format (tests/infer/executors/test_tp_quantized.py covers int8 / int4 TP)
    out = _run("tp_decode.py", "--quick", "--model", "debug", "--dtypes", "float32")
    assert [r["dtype"] for r in out["results"]] == ["float32"]
    for r in out["results"]:
        assert r["one_process_tokens_per_s"][0] > 0 and r["tp2_tokens_per_s"][0] > 0
        assert r["ratio_of_medians"] > 0 and r["ratio_vs_best_one_process"] > 0
        assert r["one_process_2_threads_tokens_per_s"][0] > 0
    assert out["results"][0]["same_tokens"] is True  # fp32 on the test prompt


def test_bad_model_is_one_line() -> None:
    for script, args in (("dist_decode.py", ["--quick", "--model", "nosuchmodel"]),
                         ("ppd_processes.py", ["nosuchmodel"]),
                         ("tp_decode.py", ["--quick", "--model", "nosuchmodel"])):
        proc = subprocess.run([sys.executable, str(BENCH / script), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, script
        assert "Traceback" not in proc.stderr and "'nosuchmodel'" in proc.stderr, script
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_self_spec_ceiling_accepts_every_draft() -> None:
    """Layers after the exit add nothing, so every draft is accepted and the output is plain
    decoding's, in fp32 and fp16 (the benchmark exits non-zero otherwise)."""
    for dtype in ("float32", "float16"):
        out = _run("self_spec_ceiling.py", "--layers", "4", "--dim", "32", "--heads", "2",
                   "--hidden", "64", "--exit-layer", "2", "--drafts", "3", "--contexts", "5,40",
                   "--new-tokens", "12", "--repeats", "1", "--dtype", dtype)
        assert [r["context"] for r in out["results"]] == [5, 40]
        for r in out["results"]:
            assert r["identical"] and r["acceptance"] == 1.0, r
            assert r["ar_tokens_per_s"] > 0 and r["self_spec_tokens_per_s"] > 0


def test_batch_decode_quick() -> None:
    out = _run("batch_decode.py", "--model", "debug", "--quick", "--dtype", "int8")
    assert [r["batch"] for r in out["rows"]] == [1, 2] and out["dtype"] == "int8"
    for row in out["rows"]:
        assert row["identical_to_alone"] is True
        assert row["torch_tokens_per_s"] > 0 and row["native_tokens_per_s"] > 0


def test_huge_pages_quick() -> None:
    out = _run("huge_pages.py", "--model", "debug", "--quick", "--min-bytes", "0")
    [row] = out["rows"]
    assert row["dtype"] == "float32" and row["identical"] is True
    assert row["placed"] is out["huge_pages_available"]
    assert row["small_pages_tokens_per_s"] > 0 and row["huge_pages_tokens_per_s"] > 0


def test_chunked_prefill_quick() -> None:
    out = _run("chunked_prefill.py", "--model", "debug", "--quick")
    whole, parts = out["settings"]["whole"], out["settings"]["32"]
    assert whole["tokens_while_it_filled"] == 0  # the whole prefill holds the others
    assert parts["tokens_while_it_filled"] == 2 * out["streams"]  # 96 = 3 parts: 2 steps between
    for s in (whole, parts):
        assert s["long_tokens_equal_whole"] is True and s["max_gap_s"] > 0


def test_shared_prefill_quick() -> None:
    out = _run("shared_prefill.py", "--model", "debug", "--quick")
    rows = out["results"]
    assert {(r["choices"], r["prefill_chunk"], r["shared"]) for r in rows} == {
        (1, None, True), (3, None, True), (3, None, False), (1, 16, True), (3, 16, True),
        (3, 16, False)}
    for r in rows:
        assert r["all_first_tokens_s"] > 0
        if r["choices"] > 1 and r["shared"]:
            assert r["same_tokens_as_unshared"] is True and r["speedup_vs_unshared"] > 0
    start = out["shared_start"]
    assert start["same_tokens_as_unshared"] is True and start["arriving"] == 3
    assert start["start_tokens"] >= 32 and start["speedup_vs_unshared"] > 0


def test_adaptive_self_spec_fresh_passes() -> None:
    """``--fresh``: passes on models loaded anew per variant (a new process's planner), the
    shipped model's recorded round fixed beside adaptive rounds, outputs checked."""
    out = _run("adaptive_self_spec.py", "--model", "layerskip-code", "--quick", "--exits",
               "10", "--specs", "4", "--fresh", "1")
    fresh = out["fresh"]
    assert fresh["exact_match"] is True and len(fresh["passes"]) == 1
    assert set(fresh["over_ar"]) == {"ar", "adaptive", "hint-fixed"}
    assert fresh["over_ar"]["ar"] == 1.0
    assert all(r > 0 for r in fresh["over_ar"].values())
    assert out["results"]["adaptive"]["exact_match"] == 1.0


def test_greedy_heads_quick() -> None:
    out = _run("greedy_heads.py", "--quick", "--model", "debug")
    assert list(out["results"]) == ["float32", "float16", "int8", "int4"]
    for prec, res in out["results"].items():
        head = res["head_step"]
        assert head["agree"] is True and head["steps"] > 0, prec
        assert head["screened_us_median"] > 0 and head["full_us_median"] > 0
        assert head["candidates_median"] >= 1
        assert res["greedy_screens"] is (prec in ("float32", "float16", "int4"))
        if res["greedy_screens"]:
            assert res["decoding"]["identical"] is True
        else:
            assert res["decoding"] is None
    assert out["results"]["int8"]["head_step"]["screen"] == "QuantizedScreen"
