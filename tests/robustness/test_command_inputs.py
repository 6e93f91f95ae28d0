"""Inputs a demanding user gives ``train``, ``plan``, ``bench``, ``lm-eval`` and ``humaneval``
that earlier passes did not cover: keys given twice in YAML, windows longer than the model's
context, objectives with nothing to train, hand-edited checkpoint state, planner inputs whose
work or memory would explode, sweep and mode flags that would be ignored. Each is one clear
line (exit status 2) or the right result, in bounded time and memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from _robust_util import assert_clean_error, cli, cli_subprocess, run_config

from exitlm.plan import terapipe
from exitlm.plan.cost_model import PlanError
from exitlm.plan.terapipe import DPBudget, PerfModel, best_uniform, plan_slices, slicing_latency
from exitlm.plan.terapipe import uniform_slicing as uniform

TIMES = "0.1,0.2,1,2,0.5,1,0.5,1"


def _yaml(root: Path, text: str, name: str = "cfg.yaml") -> Path:
    file = root / name
    file.write_text(text)
    return file


def _run_yaml(root: Path, **sections: dict) -> Path:
    return _yaml(root, yaml.safe_dump(run_config(root, **sections).to_dict()), "run.yaml")


# ----- train ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "needles"), [
    ("preset: tiny\ntrain: {steps: 3}\ntrain: {steps: 5}\n", ["cfg.yaml:3", "'train'", "line 2"]),
    ("preset: tiny\ntrain:\n  steps: 3\n  batch_size: 2\n  steps: 7\n",
     ["cfg.yaml:5", "'steps'", "line 3"]),
])
def test_a_key_given_twice_in_a_config_file(text: str, needles: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", _yaml(tmp_path, text), "--print-config"], capsys)
    assert_clean_error(res, *needles, "twice")


def test_a_key_given_twice_in_an_override(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", "tiny", "--print-config",
               "model.exits={layers: [1], layers: [2]}"], capsys)
    assert_clean_error(res, "model.exits=", "'layers'", "twice")


def test_merge_keys_and_anchors_still_work(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    text = "preset: tiny\ntrain:\n  <<: {steps: 4}\n  batch_size: 2\noptim: &o {lr: 0.01}\n"
    res = cli(["train", "--config", _yaml(tmp_path, text), "--print-config"], capsys)
    assert res.rc == 0, res.err
    cfg = yaml.safe_load(res.out)
    assert cfg["train"]["steps"] == 4 and cfg["train"]["batch_size"] == 2


@pytest.mark.parametrize("init", ["debug", "debug-gpt2"])
def test_windows_longer_than_the_context_are_refused(init: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2's learned positions end at max_seq_len (a traceback before), RoPE's model would
    be trained on positions it then refuses (and a step of 100000 tokens takes minutes)."""
    file = _run_yaml(tmp_path)
    res = cli(["train", "--config", file, f"model.init={init}", "model.overrides={}",
               "data.seq_len=300"], capsys)
    assert_clean_error(res, "data.seq_len=300", "max_seq_len=256")
    assert not (tmp_path / "run" / "log.jsonl").exists()


@pytest.mark.parametrize("overrides", [
    ["loss.final_weight=0", "loss.weight_schedule=warmup", "loss.exit_weights_initial=0"],
    ["loss.final_weight=0", "loss.weight_schedule=constant", "loss.exit_weights=0"],
])
def test_an_objective_with_nothing_to_train_names_the_weights(
        overrides: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", _run_yaml(tmp_path), *overrides], capsys)
    assert_clean_error(res, "every weight is 0 at step 0", "loss.final_weight=0")


def test_an_unknown_data_tokenizer_names_the_setting(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", _run_yaml(tmp_path), "data.tokenizer=no-such-tokenizer"],
              capsys)
    assert_clean_error(res, "data.tokenizer='no-such-tokenizer'", "not a known name")
    res = cli(["eval", "debug", "--tokenizer", "no-such-tokenizer"], capsys)
    assert_clean_error(res, "--tokenizer 'no-such-tokenizer'", "not a known name")


@pytest.mark.parametrize(("override", "needles"), [
    ("parallel.timeout_s=1.0e+30", ["parallel.timeout_s", "604800", "1e+30"]),
    ("parallel.timeout_s=.inf", ["parallel.timeout_s", "604800", "inf"]),
    ("parallel.fill_microbatches=1000000000000", ["parallel.fill_microbatches=1000000000000",
                                                  "pp - 1 = 0"]),
])
def test_parallel_waits_and_bubble_fills_are_bounded(override: str, needles: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A timeout that overflows thread joins and socket timeouts, and a bubble-filling count
    that would build a schedule of 10^12 microbatches, are refused before any work."""
    res = cli(["train", "--config", "tiny", "--print-config", override], capsys)
    assert_clean_error(res, *needles)


def test_resume_from_hand_edited_checkpoint_state(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A state.json whose step or data position is negative (a traceback, or "resumed at step
    -5") is a damaged checkpoint: the previous one is resumed, with a warning."""
    file = _run_yaml(tmp_path, train={"steps": 2, "checkpoint_every": 1})
    assert cli(["train", "--config", file], capsys).rc == 0
    ckpts = tmp_path / "run" / "checkpoints"
    for name, key, value in (("step-00000002", "data_position", -7),
                             ("step-00000001", "step", -5)):
        state = ckpts / name / "state.json"
        data = json.loads(state.read_text())
        data[key] = value
        state.write_text(json.dumps(data))
    res = cli(["train", "--config", file, "train.steps=3", "--resume"], capsys)
    line = assert_clean_error(res, "none of the 2 checkpoint(s)", "readable")
    assert "data_position must be an integer >= 0, got -7" in res.err, line
    assert "step must be an integer >= 0, got -5" in res.err, line


# ----- plan -----------------------------------------------------------------------------------

PIPELINE_ERRORS = [
    (["--times=-1,0.2,1,2,0.5,1,0.5,1"], ["--times", "-1.0", ">= 0"]),
    (["--times", "nan,0.2,1,2,0.5,1,0.5,1"], ["--times", "nan"]),
    (["--times", "1e308,1e308,1e308,1e308,1,1,1,1"], ["overflow", "--times"]),
    (["--times", TIMES, "--memory", "1e308,1,1,1,1,1,1,1", "--alpha", "1e308"],
     ["overflow", "--memory"]),
    (["--times", TIMES, "--exits-per-stage", "1.5,0,0,0"], ["--exits-per-stage", "'1.5,0,0,0'"]),
    (["--times", TIMES, "--exits-per-stage", "nan,0,0,0"], ["--exits-per-stage", "integers"]),
]


@pytest.mark.parametrize(("args", "needles"), PIPELINE_ERRORS,
                         ids=[" ".join(a) for a, _ in PIPELINE_ERRORS])
def test_plan_pipeline_values(args: list[str], needles: list[str],
                              capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["plan", "pipeline", "--stages", "4", "--microbatches", "8", *args], capsys)
    assert_clean_error(res, *needles)


def test_plan_pipeline_bubble_filling_of_many_stages_is_bounded() -> None:
    """200 stages with both fills: ~270 microbatches per stage, simulated 33 times to order
    the cool-down (over a minute before, cubic in the stages): refused at once."""
    res = cli_subprocess(["plan", "pipeline", "--stages", "200", "--microbatches", "1",
                          "--times", TIMES, "--fill", "both"], timeout=60)
    assert_clean_error(res, "--stages 200", "bubble-filling microbatches", "at most")


def test_plan_pipeline_bubble_filling_still_plans(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["plan", "pipeline", "--stages", "4", "--microbatches", "8", "--exits-per-stage",
               "0,1,1,0", "--times", TIMES, "--fill", "both", "--json"], capsys)
    assert res.rc == 0, res.err
    assert json.loads(res.out)["bubble_filling"]["time_per_iteration_simulated"] > 0


def _profile(path: Path, seq_len: int, **extra: object) -> Path:
    rng = np.random.default_rng(0)
    t = [1e-4 * i + float(x) for i, x in enumerate(rng.uniform(0, 1e-5, seq_len), 1)]
    path.write_text(json.dumps({"seq_len": seq_len, "stages": 4, "unit": "s", "t_noctx": t,
                                "ctx_coef": [1e-6, 1e-8, 1e-8, 1e-10], **extra}))
    return path


def test_plan_terapipe_enumeration_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The paper's enumeration with --epsilon 0 evaluates up to L^2 / 2 candidates (hours
    from L = 2000 on); past the planner's budget (shrunk here) it stops with the way out."""
    prof = _profile(tmp_path / "p.json", 200)
    res = cli(["plan", "terapipe", "--profile", prof, "--method", "enumerate"], capsys)
    assert res.rc == 0, res.err  # hundreds of evaluations: well within the budget
    monkeypatch.setattr(terapipe, "MAX_DP_WORK", 10_000_000)
    res = cli(["plan", "terapipe", "--profile", prof, "--method", "enumerate"], capsys)
    assert_clean_error(res, "200 tokens", "dynamic-program evaluations")
    assert "--method bisect" in res.err


def test_the_budget_is_shared_and_checked_before_the_work() -> None:
    cost = PerfModel(tuple(float(i) for i in range(1, 41))).matrix()
    with pytest.raises(PlanError, match="stopped after 0 dynamic-program evaluations"):
        plan_slices(cost, 2, budget=DPBudget(100))
    assert plan_slices(cost, 2, method="bisect", budget=DPBudget(10**9))["latency"] > 0


@pytest.mark.parametrize("batch", [[{"t_noctx": [1.0] * 5}], [{"t_noctx": [1.0] * 30000}], [5]])
def test_plan_terapipe_batch_profiles_must_match_the_sequence(
        batch: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A batch size's profile of another length was planned as if it were the sequence (a
    plan of 5 tokens for 10), or built a 30000^2 cost table past the memory check."""
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"seq_len": 10, "stages": 2, "t_noctx": [1.0] * 10,
                                "batch": batch}))
    res = cli(["plan", "terapipe", "--profile", prof, "--batch", "1"], capsys)
    assert_clean_error(res, "p.json", "batch[0]")


def test_plan_terapipe_batch_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["plan", "terapipe", "--profile", "x.json", "--batch", "100000"], capsys)
    assert_clean_error(res, "--batch", "[0, 1024]")


def test_best_uniform_matches_the_slice_by_slice_search() -> None:
    rng = np.random.default_rng(1)
    for n, stages in ((1, 1), (7, 3), (40, 4)):
        cost = PerfModel(tuple(rng.uniform(0.1, 2.0, n)), (0.1, 0.01, 0.02, 0.001)).matrix()
        lats = [slicing_latency(cost, uniform(n, k), stages) for k in range(1, n + 1)]
        got = best_uniform(cost, stages)
        assert got["num_slices"] == int(np.argmin(lats)) + 1
        assert got["latency"] == min(lats) and got["slices"] == uniform(n, got["num_slices"])


# ----- bench ----------------------------------------------------------------------------------

BENCH_ERRORS = [
    (["--sweep", "threshold", "--sweep-thresholds", ","], ["--sweep-thresholds", "','"]),
    (["--sweep", "threshold", "--sweep-thresholds", "0.5,2"], ["--sweep-thresholds", "'2'"]),
    (["--sweep", "speculation", "--sweep-exits", ","], ["--sweep-exits", "','"]),
    (["--sweep", "speculation", "--sweep-speculations", "0"], ["--sweep-speculations", "0"]),
    (["--sweep-exits", "2"], ["--sweep-exits applies to --sweep speculation"]),
    (["--sweep", "threshold", "--sweep-exits", "2"], ["--sweep-exits", "ignored"]),
    (["--limit", "2"], ["--limit applies to --task"]),
    (["--task", "docstrings", "--sweep", "threshold"], ["--task docstrings", "--sweep"]),
    (["--strategies", ",,"], ["--strategies", "got ',,'"]),
]


@pytest.mark.parametrize(("args", "needles"), BENCH_ERRORS,
                         ids=[" ".join(a) for a, _ in BENCH_ERRORS])
def test_bench_flags_that_would_be_ignored_or_are_empty(
        args: list[str], needles: list[str], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["bench", "--model", "debug", "--out-dir", tmp_path / "out", *args], capsys)
    assert_clean_error(res, *needles)
    assert not (tmp_path / "out" / "sweep_thresholds.csv").exists()


def test_bench_prompts_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every prompt of the file runs unless --num-prompts says otherwise (8 of 10 ran
    before); an empty prompt is named by its line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(f"p{i}") for i in range(10)))
    args = ["bench", "--model", "debug", "--strategies", "ar", "--max-new-tokens", "1",
            "--out-dir", tmp_path / "out", "--prompts", prompts, "--json"]
    res = cli(args, capsys)
    assert res.rc == 0, res.err
    assert json.loads(res.out)["prompts"] == 10
    res = cli([*args, "--num-prompts", "3"], capsys)
    assert res.rc == 0 and json.loads(res.out)["prompts"] == 3, res.err
    prompts.write_text('"a"\n""\n')
    assert_clean_error(cli(args, capsys), "p.jsonl:2", "empty")


def test_bench_ratio_over_an_unmeasured_strategy(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """One new token: no decode time anywhere; the ratios over transformers' strategies were
    a ZeroDivisionError."""
    res = cli(["bench", "--model", "debug", "--strategies", "self-spec,hf-ee,hf",
               "--max-new-tokens", "1", "--num-prompts", "1", "--out-dir", tmp_path, "--json"],
              capsys)
    assert res.rc == 0, res.err
    assert "self_spec_over_hf_ee" not in json.loads(res.out)["ratios"]


# ----- lm-eval and humaneval -----------------------------------------------------------------

@pytest.mark.parametrize("limit", ["nan", "inf", "-3", "0"])
def test_lm_eval_limit(limit: str, capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["lm-eval", "--tasks", "x", "--limit", limit], capsys)
    assert_clean_error(res, "--limit", repr(limit))


def test_lm_eval_include_path_that_is_no_directory(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["lm-eval", "--tasks", "x", "--include-path", tmp_path / "none"], capsys)
    assert_clean_error(res, "--include-path", "not a directory")


def test_lm_eval_unknown_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("lm_eval")
    res = cli(["lm-eval", "--model", "debug", "--tasks", "no_such_task_anywhere",
               "--include-path", tmp_path], capsys)
    assert_clean_error(res, "--tasks no_such_task_anywhere", "not found")


def test_humaneval_out_is_checked_first_and_never_replaces_foreign_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "results.json").write_text('{"mine": 1}')
    res = cli(["humaneval", "--model", "debug", "--limit", "1", "--out", tmp_path], capsys)
    assert_clean_error(res, "--out", "results.json", "not written by exitlm humaneval")
    assert "loading debug" not in res.err  # before the model and the generation
    assert (tmp_path / "results.json").read_text() == '{"mine": 1}'
