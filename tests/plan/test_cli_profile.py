"""`exitlm plan` commands (JSON output, errors) and the profiling / analytic cost sources."""

from __future__ import annotations

import json

import pytest

from _steady_profile import steady_median_time
from exitlm.cli import main
from exitlm.config import preset
from exitlm.plan.profile import analytic_costs, profile_costs, profile_terapipe


def _run(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else {"err": out.err})


def test_plan_ppd_json(capsys) -> None:
    rc, out = _run(capsys, ["plan", "ppd", "--layers", "40", "--exit-layer", "20", "--k", "5",
                            "--tokens", "128", "--p-correct", "0.7415", "--json"])
    assert rc == 0
    # Theorem 4.1 by hand: 40*128 - 20*127*0.7415 and + 5*20*128
    assert out["latency"] == pytest.approx(5120 - 20 * 127 * 0.7415)
    assert out["compute"] == pytest.approx(out["latency"] + 12800)
    assert round(out["approx_latency_per_token_normalized"], 3) == 0.629
    assert round(out["approx_compute_per_time_unit"], 3) == 4.973
    rc, out = _run(capsys, ["plan", "ppd", "--layers", "40", "--exit-layer", "10", "--k", "1",
                            "--tokens", "8", "--p-correct", "0.5", "--json"])
    assert rc == 2 and "d/2 <= d_bar" in out["err"]


def test_plan_terapipe_profile_json(tmp_path, capsys) -> None:
    n = 24
    prof = {"seq_len": n, "stages": 4, "t_noctx": [0.5 + 0.02 * i for i in range(1, n + 1)],
            "ctx_coef": [0.01, 0.001, 0.002, 0.0005]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    rc, out = _run(capsys, ["plan", "terapipe", "--profile", str(path), "--json",
                            "--plot", str(tmp_path / "tp.svg")])
    assert rc == 0 and sum(out["slices"]) == n
    assert out["latency"] <= out["best_uniform"]["latency"] + 1e-12
    assert (tmp_path / "tp.svg").exists()
    rc, out2 = _run(capsys, ["plan", "terapipe", "--profile", str(path), "--method",
                             "enumerate", "--json"])
    assert out2["latency"] == pytest.approx(out["latency"])
    prof["t_noctx"] = prof["t_noctx"][:-1]
    path.write_text(json.dumps(prof))
    rc, out = _run(capsys, ["plan", "terapipe", "--profile", str(path), "--json"])
    assert rc == 2 and "t_noctx" in out["err"]


@pytest.mark.parametrize(("content", "expected"), [
    (b'{"seq_len": 2, "stages": 2, "t_noctx": [1.0, "a"]}', "'t_noctx' must be a list of numbers"),
    (b'{"seq_len": 2, "stages": 2, "t_noctx": 5}', "'t_noctx' must be a list of numbers"),
    (b'{"seq_len": 2, "stages": 2, "t_noctx": [1, 2], "ctx_coef": [0, 0, 0, true]}',
     "'ctx_coef' must be a list of numbers"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"seq_len": 2,', "invalid JSON"),
])
def test_plan_terapipe_bad_profiles_name_the_file_and_key(tmp_path, capsys, content: bytes,
                                                         expected: str) -> None:
    path = tmp_path / "prof.json"
    path.write_bytes(content)
    rc, out = _run(capsys, ["plan", "terapipe", "--profile", str(path), "--json"])
    assert rc == 2 and expected in out["err"] and str(path) in out["err"], out["err"]
    assert "Traceback" not in out["err"] and len(out["err"].strip().splitlines()) <= 2


def test_plan_terapipe_profile_must_be_a_regular_file(capsys) -> None:
    rc, out = _run(capsys, ["plan", "terapipe", "--profile", "/dev/zero", "--json"])
    assert rc == 2 and "/dev/zero" in out["err"] and "not a regular file" in out["err"]


def test_plan_terapipe_model_profiles_real_layers(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("exitlm.plan.profile._median_time", steady_median_time)
    save = tmp_path / "prof.json"
    rc = main(["plan", "terapipe", "--model", "debug", "--seq-len", "12", "--stages", "2",
               "--save-profile", str(save), "--repeats", "2", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = json.loads(cap.out)
    assert sum(out["slices"]) == 12 and out["time_unit"] == "s"
    assert len(json.loads(save.read_text())["t_noctx"]) == 12
    # progress on a pipe: a start and an end line per profiling phase, on stderr
    err = [ln for ln in cap.err.splitlines() if ln.startswith("exitlm: profiling")]
    assert err[0] == "exitlm: profiling t(i, 0) of one stage (2 layers) (12 lengths)..."
    assert err[1].startswith("exitlm: profiling t(i, 0) of one stage (2 layers): done, "
                             "12 lengths in ")
    assert "t_ctx(i, j)" in err[2] and err[3].endswith(" s") and len(err) == 4


def test_plan_pipeline_json_and_plot(tmp_path, capsys) -> None:
    rc, out = _run(capsys, [
        "plan", "pipeline", "--stages", "4", "--microbatches", "6", "--exits-per-stage",
        "0,1,1,0", "--times", "0.1,0.2,1,2,0.5,1,0.5,1", "--memory",
        "1,0.1,4,2,1,0.5,1,0.5", "--fill", "both", "--plot", str(tmp_path / "t.png"),
        "--json"])
    assert rc == 0
    # App. A.3.1 Step 3 by hand: 0.3 + 3*3 + 2*1.5 + 6*max(3.3, 4.5, 4.5, 4.5)
    assert out["time_per_iteration_bound"]["total"] == pytest.approx(39.3)
    assert out["time_per_iteration_simulated"] == pytest.approx(39.3)
    assert out["stages"][0]["memory"]["total"] == pytest.approx(5 + 4 * 2 + 4 * 0.1)
    assert out["bubble_filling"]["time_per_iteration_simulated"] == pytest.approx(39.3)
    assert (tmp_path / "t.png").stat().st_size > 0
    rc, out = _run(capsys, ["plan", "pipeline", "--stages", "4", "--microbatches", "6",
                            "--times", "1,2,3", "--json"])
    assert rc == 2 and "--times needs 8" in out["err"]


def test_plan_pipeline_from_model_with_recommendation(capsys) -> None:
    rc, out = _run(capsys, ["plan", "pipeline", "--stages", "2", "--microbatches", "4",
                            "--model", "debug", "--seq-len", "32", "--recommend", "1",
                            "--json"])
    assert rc == 0 and out["recommendation"]["exits_per_stage"] == [0, 1]
    assert out["time_per_iteration_simulated"] <= out["time_per_iteration_bound"]["total"] * (
        1 + 1e-9)


def test_analytic_and_measured_costs() -> None:
    cfg = preset("debug")
    a = analytic_costs(cfg, 2, 64, 2, flops_per_s=1e9, bytes_per_s=1e15)
    # compute bound here: backward = 2 x forward FLOPs
    assert a["BB"].b == pytest.approx(2 * a["BB"].f)
    assert a["FE"].f == pytest.approx(2 * 128 * cfg.dim * cfg.vocab_size / 1e9)
    m = profile_costs(cfg, 2, 16, 1, repeats=1, threads=1)
    # two blocks of parameters in fp32
    import torch

    from exitlm.model.layers import Block
    per_block = sum(p.numel() for p in Block(cfg).parameters()) * 4
    assert m["BB"].m == 2 * per_block
    assert all(c.f > 0 and c.m_act > 0 for c in m.values())
    pm, raw = profile_terapipe(cfg, 8, 2, repeats=1, threads=1)
    assert pm.seq_len == 8 and raw["layers_per_stage"] == 2
    assert torch.get_num_threads() >= 1


@pytest.mark.parametrize("fill,slices", [("none", 1), ("both", 1), ("cooldown", 2)])
def test_plan_pipeline_simulates_the_actions_train_executes(capsys, fill: str,
                                                            slices: int) -> None:
    """``exitlm plan pipeline`` times the very action lists a training stage runs: a 4-stage
    engine with exits on stages 1 and 2, ``parallel.bubble_fill``, ``backward_forward_ratio``
    and ``token_slices`` set like the plan's ``--fill``, ``--times`` (b = 2f) and
    ``--token-slices``."""
    import torch

    from exitlm import EarlyExitLM, ExitConfig
    from exitlm.train.parallel.dims import ParallelConfig, ParallelDims
    from exitlm.train.parallel.pipeline.engine import PipelineEngine

    plan_fill = {"none": "none", "both": "both", "cooldown": "part2"}[fill]
    rc, out = _run(capsys, ["plan", "pipeline", "--stages", "4", "--microbatches", "6",
                            "--exits-per-stage", "0,1,1,0", "--times", "0,0,1,2,0,0,0,0",
                            "--fill", plan_fill, "--token-slices", str(slices), "--json"])
    assert rc == 0, out
    cfg = preset("debug", tie_embeddings=False,
                 exits=ExitConfig(layers=(1, 2), output="own", norm="own"))
    pc = ParallelConfig(pp=4, bubble_fill=fill, backward_forward_ratio=2.0,
                        token_slices=slices)
    eng = PipelineEngine(EarlyExitLM(cfg), pc, ParallelDims.build(4, 0, pp=4), microbatches=6,
                         slices=pc.slice_lengths(8), device=torch.device("cpu"))
    assert out["actions"] == [" ".join(map(str, acts)) for acts in eng.schedule.actions]
