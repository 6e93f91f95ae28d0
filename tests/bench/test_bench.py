"""``exitlm bench`` pieces: ROUGE-L, built-in prompts, summaries, PPD vs theory, and a tiny
end-to-end run with a sweep (no transformers models involved)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exitlm.bench.report import _sweep as sweep_lines
from exitlm.bench.run import Run, builtin_prompts, load_prompts, ppd_vs_theory, summarize
from exitlm.cli import main
from exitlm.errors import ExitlmError
from exitlm.infer.ppd import PPDStats
from exitlm.infer.rouge import rouge_l, words
from exitlm.infer.self_speculative import SelfSpecStats
from exitlm.kernels import native
from exitlm.plan.ppd_theory import expected_latency


def test_rouge_l_by_hand() -> None:
    cand, ref = "the cat sat on the mat", "the cat is on the mat"
    r = rouge_l(cand, ref)  # LCS "the cat on the mat" = 5 of 6 tokens on both sides
    assert r.precision == r.recall == pytest.approx(5 / 6) and r.f == pytest.approx(5 / 6)
    r = rouge_l("a b", "a b c d")
    assert (r.precision, r.recall) == (1.0, 0.5) and r.f == pytest.approx(2 / 3)
    assert rouge_l("", "").f == 1.0 and rouge_l("x", "").f == 0.0
    assert words("return f(x)+1") == ["return", "f", "(", "x", ")", "+", "1"]
    assert rouge_l("return f(x)", "return f(x)").f == 1.0
    # code punctuation counts (the package's default tokenizer would drop it)
    assert rouge_l("f(x)", "f[x]").f == pytest.approx(0.5)


def test_builtin_prompts_are_held_out_function_heads() -> None:
    ps = builtin_prompts(3)
    assert len(ps) == 3
    for p in ps:
        assert p.startswith("def ") and '"""' in p and p.endswith("\n    ")
    assert builtin_prompts(3) == ps  # deterministic


def test_load_prompts_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('"a"\n\n{"prompt": "b"}\n', encoding="utf-8")
    assert load_prompts(str(f)) == ["a", "b"]
    f.write_text('"a\u2028b"\n"c"\n', encoding="utf-8")  # U+2028 is not a line break here
    assert load_prompts(str(f)) == ["a\u2028b", "c"]


def test_load_prompts_never_reads_an_endless_file() -> None:
    """``/dev/zero`` (size 0 to ``stat``, no line end ever) is refused, not read."""
    with pytest.raises(ExitlmError, match="--prompts /dev/zero: a character device"):
        load_prompts("/dev/zero")


def test_summarize_and_ppd_theory() -> None:
    ar = [Run([1, 2, 3], "a b c", 2.0, 2, 2.5), Run([4, 5], "d e", 1.0, 1, 1.2)]
    other = [Run([1, 2, 9], "a b z", 1.0, 2, 1.5, SelfSpecStats(drafted=4, accepted=3)),
             Run([4, 5], "d e", 0.5, 1, 0.7, SelfSpecStats(drafted=2, accepted=1))]
    s = summarize(other, ar)
    assert s["decode_tokens_per_s"] == pytest.approx(3 / 1.5)
    assert s["exact_match"] == 0.5 and s["acceptance_rate"] == pytest.approx(4 / 6)
    assert s["rouge_l"] == pytest.approx((2 / 3 + 1) / 2)
    ppd = [Run([1] * 11, "", 3.0, 10, 3.5, PPDStats(forks=9, matches=3))]
    ref = [Run([1] * 11, "", 4.0, 10, 4.5)]
    t = ppd_vs_theory(ppd, ref, 30, 20, 1)
    unit = 4.0 / 10 / 30
    pred = expected_latency(30, 20, 1, 10, 3 / 9) * unit
    assert t["p_correct"] == pytest.approx(1 / 3)
    assert t["per_prompt"][0]["predicted_s"] == pytest.approx(pred)
    assert t["measured_over_predicted_latency"] == pytest.approx(3.0 / pred)


def _table_rows(text: str, first: str) -> dict[str, dict[str, str]]:
    """The rows of the aligned table whose header starts with ``first``, by first cell
    (columns are cut at the header's column starts; headers are separated by 2 spaces)."""
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith(first + " "))
    widths = [len(d) for d in lines[head + 1].split("  ")]
    starts = [sum(widths[:k]) + 2 * k for k in range(len(widths))]
    names = [lines[head][a:a + w].strip() for a, w in zip(starts, widths, strict=True)]
    out = {}
    for ln in lines[head + 2:]:
        if "  " not in ln:  # the lines below the table
            break
        cells = [ln[a:a + w].strip() for a, w in zip(starts, widths, strict=True)]
        out[cells[0]] = dict(zip(names, cells, strict=True))
    return out


@pytest.fixture
def _keep_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("_keep_threads")
def test_bench_end_to_end_on_a_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"def f(x):"\n"Hello"\n', encoding="utf-8")
    args = ["bench", "--model", "debug", "--prompts", str(prompts), "--max-new-tokens", "6",
            "--out-dir", str(tmp_path / "out")]
    rc = main([*args, "--strategies", "ar,early-exit,self-spec,ppd", "--exit-layer", "2",
               "--threshold", "0.0", "--ppd-layer", "2"])
    assert rc == 0
    table = capsys.readouterr().out
    rep = json.loads((tmp_path / "out" / "bench.json").read_text())
    res = rep["results"]
    assert res["self-spec"]["exact_match"] == res["ppd"]["exact_match"] == 1.0
    assert "acceptance_rate" in res["self-spec"] and res["early-exit"]["mean_exit_layer"] < 4
    assert rep["ratios"]["self_spec_over_ar"] > 0 and "ppd_theory" in rep
    # the table: one row per strategy with the report's tokens/s and speed-up over ar
    rows = _table_rows(table, "strategy")
    assert set(rows) == set(res) == {"ar", "early-exit", "self-spec", "ppd"}
    for name, r in res.items():
        row = rows[name]
        assert float(row["decode tok/s"].replace(",", "")) == pytest.approx(
            r["decode_tokens_per_s"], rel=0.01)
        assert row["vs ar"].endswith("x")
        assert float(row["vs ar"][:-1]) == pytest.approx(r["decode_speedup_vs_ar"], abs=0.005)
        assert row["same as ar"] == {1.0: "yes", 0.0: "no"}.get(r["exact_match"],
                                                                 row["same as ar"])
    assert rows["ar"]["vs ar"] == "1.00x" and rows["ar"]["acceptance"] == "-"
    assert float(rows["self-spec"]["acceptance"]) == pytest.approx(
        res["self-spec"]["acceptance_rate"], abs=0.005)
    assert f"self-spec over ar {rows['self-spec']['vs ar']}" in table
    assert "drafted through" not in table and res["self-spec"]["draft_weights"] == "model"
    assert "p_correct" in table and not table.lstrip().startswith("{")
    rc = main([*args, "--sweep", "speculation", "--sweep-exits", "1,2",
               "--sweep-speculations", "1,3", "--json"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "out" / "sweep_speculation.json").read_text())
    sweep = printed["sweep"]
    rows = sweep["rows"]
    assert len(rows) == 4 and all(r["exact_match"] == 1.0 for r in rows)
    assert sweep["adaptive"]["exact_match"] == 1.0 and sweep["adaptive"]["over_best_static"] > 0
    top = max(rows, key=lambda r: r["decode_tokens_per_s"])
    assert sweep["best"] == {**{k: top[k] for k in ("exit_layer", "num_speculations",
                                                    "speedup", "exact_match")},
                             "draft_weights": "model"}
    # a round faster than plain decoding is offered for the model's config (exits.draft)
    hint = f"--draft {top['exit_layer']},{top['num_speculations']}"
    faster = {**sweep, "best": {**sweep["best"], "speedup": 1.3}}
    assert any(hint in line for line in sweep_lines(faster))
    slower = {**sweep, "best": {**sweep["best"], "speedup": 0.9}}
    assert not any("--draft" in line for line in sweep_lines(slower))
    assert (tmp_path / "out" / "sweep_self_spec.csv").is_file()
    assert (tmp_path / "out" / "sweep_self_spec.png").is_file()
    if native.available():  # every cell drafts through the copy asked for, output unchanged
        rc = main([*args, "--sweep", "speculation", "--sweep-exits", "2",
                   "--sweep-speculations", "3", "--draft-weights", "int4", "--json"])
        assert rc == 0
        copied = json.loads(capsys.readouterr().out)["sweep"]
        assert copied["rows"][0]["exact_match"] == copied["adaptive"]["exact_match"] == 1.0
        assert copied["best"]["draft_weights"] == "int4"
        faster = {**copied, "best": {**copied["best"], "speedup": 1.3}}
        assert any("--draft 2,3,int4" in line for line in sweep_lines(faster))
        rc = main([*args, "--strategies", "ar,self-spec", "--exit-layer", "2",
                   "--draft-weights", "int4"])
        assert rc == 0
        assert "self-spec drafted through an int4 copy" in capsys.readouterr().out
        res = json.loads((tmp_path / "out" / "bench.json").read_text())["results"]
        assert res["self-spec"]["draft_weights"] == "int4" and res["self-spec"][
            "exact_match"] == 1.0
    rc = main([*args, "--sweep", "threshold", "--sweep-thresholds", "1.0,0.2"])
    assert rc == 0
    table = capsys.readouterr().out
    rows = json.loads((tmp_path / "out" / "sweep_threshold.json").read_text())["sweep"]["rows"]
    assert rows[0]["exact_match"] == 1.0
    shown = _table_rows(table, "threshold")
    assert list(shown) == ["1", "0.2"] and shown["1"]["same as ar"] == "yes"
    for r in rows:
        got = shown[f"{r['threshold']:g}"]["vs ar"]
        assert float(got[:-1]) == pytest.approx(r["speedup"], abs=0.005)
    assert (tmp_path / "out" / "sweep_thresholds.png").is_file()
    # the fastest threshold that kept the output everywhere is offered for the config
    sweep = json.loads((tmp_path / "out" / "sweep_threshold.json").read_text())["sweep"]
    kept = [r for r in rows if r["exact_match"] == 1.0]
    top = max(kept, key=lambda r: r["speedup"])
    assert sweep["best"] == {"threshold": top["threshold"], "speedup": top["speedup"],
                             "prompts": 2}
    hint = f"--threshold {top['threshold']:g}"
    assert any(hint in line for line in sweep_lines({**sweep, "best": {**sweep["best"],
                                                                       "speedup": 1.3}}))
    assert not any("--threshold" in line for line in sweep_lines(
        {**sweep, "best": {**sweep["best"], "speedup": 0.9}}))
    assert not any("--threshold" in line for line in sweep_lines({**sweep, "best": None}))


@pytest.mark.usefixtures("_keep_threads")
def test_bench_transformers_baselines_use_the_benchmarked_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """For any model but the embedded default, ``hf`` and ``hf-ee`` run an export of the very
    model benchmarked, so their greedy tokens equal ours (``--draft-threshold`` reaches
    both self-spec and ``transformers``' ``assistant_confidence_threshold``)."""
    pytest.importorskip("transformers")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"def f(x):"\n', encoding="utf-8")
    rc = main(["bench", "--model", "debug", "--prompts", str(prompts), "--max-new-tokens", "8",
               "--strategies", "ar,self-spec,hf,hf-ee", "--exit-layer", "2",
               "--num-speculations", "2", "--draft-threshold", "0.5",
               "--out-dir", str(tmp_path / "out"), "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    res = rep["results"]
    assert rep["config"]["options"]["hf-ee"]["draft_threshold"] == 0.5
    assert rep["config"]["options"]["self-spec"]["draft_threshold"] == 0.5
    assert res["self-spec"]["exact_match"] == 1.0
    assert res["hf"]["exact_match"] == 1.0
    assert res["hf-ee"]["exact_match"] == 1.0


@pytest.mark.usefixtures("_keep_threads")
def test_bench_fits_prompts_to_a_short_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model whose context is shorter than the built-in prompts (the 256-byte scratch
    models): the built-in prompts keep their last tokens; a prompt file that does not fit is
    one error line naming the file and the prompt, before anything runs."""
    from _tiny import byte_tokenizer, tiny_text_model
    from exitlm.io import save_model

    d = tmp_path / "short"
    save_model(tiny_text_model(), d, byte_tokenizer())  # 256 tokens of context
    args = ["bench", "--model", str(d), "--strategies", "ar", "--num-prompts", "3",
            "--out-dir", str(tmp_path / "out")]
    assert main([*args, "--max-new-tokens", "200", "--json"]) == 0
    cap = capsys.readouterr()
    assert "keep their last 56 tokens" in cap.err
    assert json.loads(cap.out)["results"]["ar"]["new_tokens"] == 3 * 200
    long = tmp_path / "long.jsonl"
    long.write_text('"short"\n' + json.dumps("x" * 100) + "\n", encoding="utf-8")
    assert main([*args, "--max-new-tokens", "200", "--prompts", str(long)]) == 2
    err = capsys.readouterr().err
    assert f"{long}: prompt 2 (100 tokens)" in err and "context of 256" in err
    assert "prompt 1/" not in err  # nothing ran
    assert main([*args, "--max-new-tokens", "256"]) == 2
    assert "--max-new-tokens 256 leaves no room" in capsys.readouterr().err


def test_unseen_code_prompts_script(tmp_path: Path) -> None:
    """benchmarks/unseen_code_prompts.py writes seeded JSONL prompts that ``exitlm bench
    --prompts`` reads; a package list with nothing installed is one line and exit 2."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "unseen_code_prompts.py"

    def run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), "--out", str(out), *args],
                              capture_output=True, text=True, timeout=120)

    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (first, again):
        proc = run(out, "--count", "4", "--packages", "pip,setuptools", "--seed", "3")
        assert proc.returncode == 0, proc.stderr
    assert first.read_text() == again.read_text()  # seeded
    prompts = load_prompts(first)
    assert len(prompts) == 4 and all("def " in p and 80 < len(p) < 600 for p in prompts)
    proc = run(tmp_path / "none.jsonl", "--packages", "no_such_package_here")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no usable *.py files" in proc.stderr and not (tmp_path / "none.jsonl").exists()


@pytest.mark.usefixtures("_keep_threads")
def test_bench_replaces_only_its_own_files_in_out_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's ``bench.json`` (or a sweep's CSV) in ``--out-dir`` is refused before anything
    runs, unless ``--overwrite``; exitlm bench's own earlier report is replaced without it."""
    out = tmp_path / "ub"
    out.mkdir()
    (out / "bench.json").write_text("mine\n")
    args = ["bench", "--model", "debug", "--strategies", "ar", "--num-prompts", "1",
            "--max-new-tokens", "2", "--out-dir", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "bench.json not written by exitlm bench" in err and "--overwrite" in err
    assert "prompt 1/" not in err  # refused before anything ran
    assert (out / "bench.json").read_text() == "mine\n"
    assert main([*args, "--overwrite"]) == 0
    first = json.loads((out / "bench.json").read_text())
    assert first["format"] == "exitlm-bench/1"
    assert main(args) == 0  # its own report: replaced without --overwrite
    capsys.readouterr()
    # a sweep's CSV is exitlm's only when its report names it
    (out / "sweep_thresholds.csv").write_text("my,numbers\n")
    sweep = [*args, "--sweep", "threshold", "--sweep-thresholds", "1.0"]
    assert main(sweep) == 2
    assert "sweep_thresholds.csv not written by exitlm bench" in capsys.readouterr().err
    assert (out / "sweep_thresholds.csv").read_text() == "my,numbers\n"
    (out / "sweep_thresholds.csv").unlink()
    assert main(sweep) == 0 and main(sweep) == 0  # the second replaces the first's files
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.json", "sweep_threshold.json", "sweep_thresholds.csv", "sweep_thresholds.png"]


def test_bench_out_dir_that_cannot_be_created(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("mine")
    rc = main(["bench", "--model", "debug", "--out-dir", str(tmp_path / "afile" / "ub")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"exitlm bench: error: --out-dir {tmp_path / 'afile' / 'ub'}: "
                          "cannot create it (") and "afile is a file" in err
    assert "\n" not in err and (tmp_path / "afile").read_text() == "mine"
