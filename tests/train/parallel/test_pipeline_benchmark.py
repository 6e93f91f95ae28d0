"""Smoke test of ``benchmarks/pipeline_train.py --quick``: it runs, prints one JSON object
with every documented field, and every time and size it reports is positive. (Timings are
never asserted against each other.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "pipeline_train.py"


def test_quick_run_prints_complete_json() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--steps", "1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert {"config", "exits", "vs_torch_pipelining", "token_slicing"} <= out.keys()
    order = out["config"]["exit_layers_order"]
    assert len(order) == 3
    seen = {(e["num_exits"], e["deferred"]) for e in out["exits"]}
    assert seen == {(k, d) for k in range(4) for d in (True, False)}
    pp = out["config"]["pp"]
    for e in out["exits"]:
        assert e["exit_layers"] == sorted(order[: e["num_exits"]])
        assert e["time_per_iter_s"] > 0 and e["overhead_vs_no_exit"] > 0
        assert e["max_peak_activation_bytes"] > 0
        assert len(e["stages"]) == pp
        assert sorted(x for s in e["stages"] for x in s["exits"]) == e["exit_layers"]
        for s in e["stages"]:
            assert s["param_bytes"] > 0 and s["peak_activation_bytes"] > 0
            assert s["resident_param_bytes"] >= s["param_bytes"]
            assert s["busy_s"] > 0
    torch_cmp = out["vs_torch_pipelining"]
    for key in ("ours_s", "torch_s", "ratio_ours_over_torch", "ratio_ours_over_torch_min"):
        assert torch_cmp[key] > 0, key
    sl = out["token_slicing"]
    assert sum(sl["slices"]) == sl["seq"] and len(sl["slices"]) > 1
    for key in ("unsliced_s", "sliced_s", "ratio_sliced_over_unsliced",
                "ratio_sliced_over_unsliced_min"):
        assert sl[key] > 0, key
