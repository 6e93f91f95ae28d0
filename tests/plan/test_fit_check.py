"""``exitlm plan terapipe`` refuses cost models that cannot support a plan, flags doubtful
fits, and prints plans readably (synthetic profiles: nothing is timed here)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from exitlm.cli import main
from exitlm.plan.fit_check import check_model, ctx_fit_r2
from exitlm.plan.terapipe import PerfModel

N = 24


def _profile(tmp_path: Path, **extra: object) -> Path:
    prof = {"seq_len": N, "stages": 4, "unit": "s",
            "t_noctx": [0.002 + 0.0001 * i for i in range(1, N + 1)],
            "ctx_coef": [1e-5, 1e-6, 2e-6, 5e-7], **extra}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    return path


def _plan(capsys: pytest.CaptureFixture[str], path: Path, *flags: str
          ) -> tuple[int, str, str]:
    rc = main(["plan", "terapipe", "--profile", str(path), *flags])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_a_fit_predicting_non_positive_times_is_refused(tmp_path: Path, capsys) -> None:
    # the context term falls steeply with context: long contexts "take" negative time
    path = _profile(tmp_path, ctx_coef=[0.0, 0.0, -0.0005, 0.0])
    for flags in ((), ("--json",)):
        rc, out, err = _plan(capsys, path, *flags)
        assert rc == 2 and out == ""  # no plan is printed
        first, hint = err.strip().splitlines()
        assert first.startswith(f"exitlm plan: error: {path}: the fitted cost model predicts "
                                "slice times <= 0")
        assert "a2=-0.0005" in first and " ms" in first
        assert "--repeats" in hint and "quieter machine" in hint


def test_a_fit_with_non_finite_predictions_is_refused(tmp_path: Path, capsys) -> None:
    path = _profile(tmp_path, ctx_coef=[0.0, 0.0, 0.0, 1e308])  # l * c * a3 overflows
    rc, out, err = _plan(capsys, path)
    assert rc == 2 and out == "" and "non-finite slice times" in err


def test_a_refused_backward_model_names_its_key(tmp_path: Path, capsys) -> None:
    path = _profile(tmp_path, t_noctx_bwd=[0.0] * N)  # zero-time backward slices
    rc, _out, err = _plan(capsys, path, "--backward")
    assert rc == 2 and "(t_noctx_bwd)" in err and "<= 0" in err


def test_injected_profile_of_a_model_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    """``--model``: a profile whose fit goes negative (as a noisy machine can give) is
    refused after profiling; the profile asked for is still saved for inspection."""
    import exitlm.plan.profile as profile

    def fake(cfg, seq_len, stages, repeats=3, threads=None, **kw):
        pm = PerfModel(tuple(1e-4 for _ in range(seq_len)), (-2e-4, 0.0, 0.0, 0.0))
        return pm, {"ctx_samples": [[4, 2, -2e-4], [4, 4, -2e-4], [8, 2, -2e-4],
                                    [8, 4, -2e-4], [2, 8, -2e-4]]}

    monkeypatch.setattr(profile, "profile_terapipe", fake)
    save = tmp_path / "prof.json"
    rc = main(["plan", "terapipe", "--model", "debug", "--seq-len", "48", "--stages", "2",
               "--save-profile", str(save)])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == ""
    assert "the profile of --model: the fitted cost model predicts slice times <= 0" in cap.err
    assert "t(1 tokens, 1 context) = -0.100 ms" in cap.err
    assert json.loads(save.read_text())["unit"] == "s"


def test_a_sane_plan_is_readable_with_units(tmp_path: Path, capsys) -> None:
    path = _profile(tmp_path)
    rc, out, err = _plan(capsys, path)
    assert rc == 0 and err == ""
    rc, js, _ = _plan(capsys, path, "--json")
    plan = json.loads(js)
    assert plan["warnings"] == [] and plan["time_unit"] == "s"
    assert math.isfinite(plan["tmax"]) and plan["tmax"] == max(plan["slice_times"])
    lines = out.splitlines()
    assert lines[0] == f"TeraPipe plan: {N} tokens in {plan['num_slices']} slice(s) over 4 stage(s)"
    assert lines[1].split() == ["slice", "tokens", "context", "time", "(ms)"]
    rows = [ln.split() for ln in lines[3:3 + plan["num_slices"]]]
    assert [int(r[1]) for r in rows] == plan["slices"]
    assert [int(r[2]) for r in rows] == [sum(plan["slices"][:k]) for k in range(len(rows))]
    for r, t in zip(rows, plan["slice_times"], strict=True):
        assert float(r[3]) == pytest.approx(t * 1e3, rel=0.01)  # seconds shown as ms
    assert "latency (Eq. 5): " in out and " ms; slowest slice (t_max): " in out
    assert f"this plan is {plan['uniform_over_dp']:.2f}x faster" in out
    assert not re.search(r"\d\.\d{5,}", out)  # no float noise
    assert "inf" not in out.lower() and "warning" not in out


def test_a_single_slice_plan_reports_a_finite_tmax(tmp_path: Path, capsys) -> None:
    """A per-slice overhead so large that one slice is best: the DP's answer comes from
    t_max = inf, and its reported t_max is the slice's time."""
    path = _profile(tmp_path, t_noctx=[1.0 + 1e-6 * i for i in range(1, N + 1)])
    rc, js, _ = _plan(capsys, path, "--json")
    plan = json.loads(js)
    assert rc == 0 and plan["slices"] == [N]
    assert plan["tmax"] == pytest.approx(1.0 + 1e-6 * N)


def test_doubtful_fits_are_flagged(tmp_path: Path, capsys) -> None:
    # measurements the fitted coefficients do not explain, and a context cost that is
    # negative for short slices with little context (t stays > 0: a plan is still made)
    pairs = [(i, j) for i in (2, 4, 8) for j in (1, 3, 5)]
    samples = [[i, j, (-1) ** k * 1e-4] for k, (i, j) in enumerate(pairs)]
    path = _profile(tmp_path, ctx_coef=[-1e-4, 1e-6, 2e-6, 5e-7],
                    measured={"ctx_samples": samples})
    rc, out, err = _plan(capsys, path)
    assert rc == 0
    warn = [ln for ln in out.splitlines() if ln.startswith("warning: ")]
    assert len(warn) == 2
    assert "t_ctx is negative for" in warn[0] and "a0=-0.0001" in warn[0]
    assert "the t_ctx fit is poor (R^2 = " in warn[1] and "on 9 measurements" in warn[1]
    rc, js, _ = _plan(capsys, path, "--json")
    assert json.loads(js)["warnings"] == [w.removeprefix("warning: ") for w in warn]
    path = _profile(tmp_path, measured={"ctx_samples": [[1, 2]]})
    rc, out, err = _plan(capsys, path)
    assert rc == 2 and "measured.ctx_samples[0] must be [i, j, t_ctx]" in err


def test_fit_r2_and_checks_by_hand() -> None:
    coef = (1.0, 2.0, 3.0, 0.5)
    exact = [(i, j, 1 + 2 * i + 3 * j + 0.5 * i * j) for i in (1, 2, 3) for j in (1, 4)]
    assert ctx_fit_r2(exact, coef) == pytest.approx(1.0)
    assert ctx_fit_r2(exact[:4], coef) is None  # too few to judge
    off = [(i, j, t + (5 if k % 2 else -5)) for k, (i, j, t) in enumerate(exact)]
    assert ctx_fit_r2(off, coef) < ctx_fit_r2(exact, coef)
    pm = PerfModel((1.0, 1.0, 1.0), (0.0, 0.0, -0.4, 0.0))  # t(1, 2) = 1 - 0.8 > 0
    assert len(check_model(pm, "x")) == 1  # negative context cost: a warning only
