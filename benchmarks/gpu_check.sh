#!/usr/bin/env bash
# The GPU checks of exitlm in one call of a lent GPU machine (CI never has one): the CUDA tests,
# then benchmarks/gpu_decode.py. Run from the repository root; logs and JSON go to $OUT (or
# ./gpu_out). Packages the machine lacks can be put on EXITLM_EXTRA_PATH (pure-Python ones).
#   bash benchmarks/gpu_check.sh [LAYERSKIP_MODEL_DIR]
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:${EXITLM_EXTRA_PATH:-}:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
$py -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
timeout "${TEST_TIMEOUT:-200}" $py -m pytest -q -p no:cacheprovider tests/infer/test_cuda.py \
    tests/runtime/test_graph_runner.py tests/train/test_cuda_train.py 2>&1 | tee "$out/tests.log" | tail -25
timeout "${BENCH_TIMEOUT:-300}" $py benchmarks/gpu_decode.py --layerskip "${1:-runs/scratch-layerskip/model}" \
    >"$out/gpu_decode.json" 2> >(tee "$out/gpu_decode.err" | grep -v "Loading weights" >&2)
echo "gpu_decode.py exit $?"
$py - "$out/gpu_decode.json" <<'PY'
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except Exception as err:  # noqa: BLE001
    sys.exit(f"no JSON: {err}")
for model, m in rep["models"].items():
    for b, res in m["batches"].items():
        for name, r in res["results"].items():
            same = r.get("identical_to_ar_eager")
            print(f"{model:9s} B={b} {name:24s} {r['decode_tokens_per_s']:9.0f} tok/s "
                  f"{r.get('vs_hf_generate', 0):6.2f}x hf {r.get('vs_ar_eager', 0):6.2f}x eager "
                  f"acc={r.get('acceptance_rate', '-')} same={same}")
        if "ppd_theory" in res:
            t = res["ppd_theory"]
            print(f"  ppd p={t['p_correct']:.3f} predicted {t['predicted_speedup']:.2f}x "
                  f"measured {t['measured_speedup']:.2f}x ratio {t['measured_over_predicted_latency']:.2f}")
PY
