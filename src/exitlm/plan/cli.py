"""``exitlm plan``: PPD theory, TeraPipe slicing and EE-LLM pipeline planning."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exitlm.args import finite_float, int_at_least, thread_count
from exitlm.errors import short_repr
from exitlm.paths import write_text_atomic
from exitlm.textfile import read_text_file

if TYPE_CHECKING:
    import numpy as np

from exitlm.plan.cost_model import (
    OpCost,
    PipelineSpec,
    PlanError,
    bubble_fill_capacity,
    iteration_time_bound,
    part1_forward_depths,
    part2_backward_stages,
    recommend_exits,
    stage_memory,
    stage_step_times,
)


def register(subparsers: Any) -> None:
    """Add ``plan`` with ``ppd``, ``terapipe`` and ``pipeline`` sub-commands."""
    plan = subparsers.add_parser("plan", help="planners: PPD theory, TeraPipe slicing, "
                                 "EE-LLM pipeline cost model and schedule simulator")
    sub = plan.add_subparsers(dest="plan_command", metavar="PLANNER")
    plan.set_defaults(func=lambda a: (plan.print_help(), 2)[1])

    p = sub.add_parser("ppd", help="expected latency / compute of Predictive Pipelined "
                       "Decoding (PPD Theorem 4.1, Eq. 3, 5, 6)")
    p.add_argument("--layers", type=int_at_least(1), required=True, help="d: number of layers")
    p.add_argument("--exit-layer", type=finite_float, required=True,
                   help="d_bar: layer of the early prediction (d/2 <= d_bar <= d)")
    p.add_argument("--k", type=int_at_least(1), required=True,
                   help="top-k candidates (sub-processes)")
    p.add_argument("--tokens", type=int_at_least(1), required=True, help="ell: tokens to generate")
    p.add_argument("--p-correct", type=finite_float, required=True,
                   help="probability that one of the top-k early predictions is the final "
                        "top-1 (the match rate measured by `exitlm eval`)")
    p.add_argument("--monte-carlo", type=int_at_least(0), default=0, metavar="RUNS",
                   help="also simulate RUNS generations and report the estimate")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_ppd)

    t = sub.add_parser("terapipe", help="TeraPipe token slicing (Sec. 3.3-3.4)",
                       description="PROFILE.json: {\"seq_len\": L, \"stages\": K, \"t_noctx\": "
                       "[t(1),...,t(L)], \"ctx_coef\": [a0,a1,a2,a3]} (one stage); optional "
                       "\"t_noctx_bwd\"/\"ctx_coef_bwd\" (backward, used with --backward) and "
                       "\"batch\": [profile for batch size 1, 2, ...] (joint plan with --batch); "
                       "optional \"unit\": \"s\" or \"ms\" (times are shown in ms). A cost "
                       "model that predicts slice times <= 0 or non-finite is refused.")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="profile JSON (see description)")
    src.add_argument("--model", help="preset name or model config JSON: profile real layers")
    t.add_argument("--seq-len", type=int_at_least(1),
                   help="L (with --model; overrides the profile's)")
    t.add_argument("--stages", type=int_at_least(1),
                   help="K (with --model; overrides the profile's)")
    t.add_argument("--epsilon", type=finite_float, default=0.0,
                   help="t_max spacing of the enumeration (result within K*eps of optimal)")
    t.add_argument("--method", choices=("bisect", "enumerate"), default="bisect",
                   help="bisect: exact branch-and-bound over t_max (default); enumerate: the "
                        "paper's small-to-large enumeration with early stop")
    t.add_argument("--backward", action="store_true",
                   help="plan on t_fwd + t_bwd (needs t_noctx_bwd in the profile)")
    t.add_argument("--batch", type=int_at_least(0, MAX_PLAN_BATCH), default=0,
                   help="joint batch x token plan for batch size B (needs \"batch\" profiles)")
    t.add_argument("--save-profile", help="with --model: write the fitted profile JSON here")
    t.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads while profiling")
    t.add_argument("--repeats", type=int_at_least(1), default=3,
                   help="with --model: timed runs per measurement (the median is kept); more "
                        "repeats give a steadier fit on a busy machine")
    t.add_argument("--plot", help="draw the sliced pipeline timeline (.png or .svg)")
    t.add_argument("--json", action="store_true", help="print JSON")
    t.set_defaults(func=_cmd_terapipe)

    q = sub.add_parser("pipeline", help="EE-LLM 1F1B cost model + schedule simulation",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=_PIPELINE_HELP)
    q.add_argument("--stages", type=int_at_least(1), required=True, help="P")
    q.add_argument("--microbatches", type=int_at_least(1), required=True, help="M")
    q.add_argument("--exits-per-stage", help="N1,...,NP (default: all 0)")
    q.add_argument("--times", help="f_in,b_in,f_bb,b_bb,f_ee,b_ee,f_fe,b_fe")
    q.add_argument("--memory", help="m_in,m_in+,m_bb,m_bb+,m_ee,m_ee+,m_fe,m_fe+ "
                   "(m_o = parameter memory, m_o+ = activation memory m_o† of one microbatch)")
    q.add_argument("--alpha", type=finite_float, default=1.0, help="Eq. 4 factor (default 1)")
    q.add_argument("--no-defer", action="store_true",
                   help="exit forward in the forward step (EE-LLM Fig. 3b) instead of deferred")
    q.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    q.add_argument("--fill", choices=("none", "part1", "part2", "both"), default="none",
                   help="simulate bubble filling (EE-LLM App. C.2.1) with the maximal counts: "
                        "part1 = parallel.bubble_fill=warmup, part2 = cooldown")
    q.add_argument("--token-slices", type=int_at_least(1), default=1, metavar="N",
                   help="TeraPipe: N equal token slices per microbatch (parallel.token_slices)")
    q.add_argument("--model", help="preset or config JSON: derive --times/--memory from it")
    q.add_argument("--seq-len", type=int_at_least(1), default=512, help="with --model")
    q.add_argument("--micro-batch", type=int_at_least(1), default=1, help="with --model")
    q.add_argument("--measure", action="store_true",
                   help="with --model: time the real modules instead of analytic FLOPs")
    q.add_argument("--flops", type=finite_float, default=1e12, help="analytic: FLOP/s")
    q.add_argument("--bandwidth", type=finite_float, default=1e11, help="analytic: bytes/s")
    q.add_argument("--recommend", type=int_at_least(0), metavar="NUM_EXITS",
                   help="with --model: suggest exit layers (EE-LLM App. A.2) and use them")
    q.add_argument("--plot", help="draw the simulated timeline (.png or .svg)")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_cmd_pipeline)


_PIPELINE_HELP = """\
Time per iteration (EE-LLM App. A.3.1), per-stage memory (Eq. 4-6), bubble-filling
counts (App. C.2.1) and a discrete-event simulation of the schedule.

Quantities (EE-LLM Table 2), any consistent units:
  --times  f_in,b_in,f_bb,b_bb,f_ee,b_ee,f_fe,b_fe   forward/backward time of one microbatch
           for the input layer, one stage's backbone, one early exit, the final exit
  --memory m_in,m_in+,m_bb,m_bb+,m_ee,m_ee+,m_fe,m_fe+   m_o parameter memory and m_o+
           (= m_o†) activation memory of one microbatch, in the same order
Example:
  exitlm plan pipeline --stages 4 --microbatches 8 --exits-per-stage 0,1,1,0 \\
      --times 0.1,0.2,1,2,0.5,1,0.5,1 --memory 1,0.1,4,2,1,0.5,1,0.5 --plot t.png --json
"""


def _floats(text: str, n: int, flag: str, names: str) -> list[float]:
    """``n`` comma-separated finite numbers >= 0 (times, memory); a :class:`PlanError`
    naming ``flag`` otherwise."""
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise PlanError(
            f"{flag} must be {n} comma-separated numbers ({names}), got {text!r}"
        ) from None
    if len(vals) != n:
        raise PlanError(f"{flag} needs {n} comma-separated numbers ({names}), got {len(vals)}")
    bad = next((x for x in vals if not math.isfinite(x) or x < 0), None)
    if bad is not None:
        raise PlanError(f"{flag}: expected finite numbers >= 0 ({names}), got {bad!r} in "
                        f"{text!r}")
    return vals


def _counts(text: str, n: int, flag: str) -> tuple[int, ...]:
    """``n`` comma-separated integers >= 0 (exits per stage); a :class:`PlanError` naming
    ``flag`` for anything else (``1.5`` is not a count)."""
    parts = [x.strip() for x in text.split(",")]
    try:
        vals = tuple(int(x) for x in parts)
    except ValueError:
        raise PlanError(f"{flag}: expected {n} comma-separated integers >= 0 (one per "
                        f"stage), got {text!r}") from None
    if len(vals) != n:
        raise PlanError(f"{flag} has {len(vals)} entries but there are {n} stages; give one "
                        "count N_i per stage")
    if any(v < 0 for v in vals):
        raise PlanError(f"{flag}: expected integers >= 0, got {text!r}")
    return vals


def _rounded(value: Any) -> Any:
    """``value`` with every float cut to 4 significant digits (text output: no float noise)."""
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _emit(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(out, indent=2, default=float))
    else:
        for k, v in out.items():
            print(f"{k}: {json.dumps(_rounded(v), default=float)}")


MAX_MONTE_CARLO_RUNS = 100_000
MAX_MONTE_CARLO_TOKENS = 100_000_000
MAX_SIMULATED_STEPS = 1_000_000


def _run(fn: Any, args: argparse.Namespace) -> int:
    try:
        return fn(args)
    except (PlanError, OSError, json.JSONDecodeError, ValueError) as e:
        hint = getattr(e, "hint", None)
        print(f"exitlm plan: error: {e}" + (f"\n  hint: {hint}" if hint else ""),
              file=sys.stderr)
        return 2


# ----- ppd -----------------------------------------------------------------------------------

def _cmd_ppd(args: argparse.Namespace) -> int:
    def body(a: argparse.Namespace) -> int:
        # lazy: loaded when the command runs
        from exitlm.plan.ppd_theory import monte_carlo, predict

        out: dict[str, Any] = {"d": a.layers, "d_bar": a.exit_layer, "k": a.k,
                               "tokens": a.tokens, "p_correct": a.p_correct}
        out.update(predict(a.layers, a.exit_layer, a.k, a.tokens, a.p_correct))
        if a.monte_carlo:
            if a.monte_carlo > MAX_MONTE_CARLO_RUNS or \
                    a.monte_carlo * a.tokens > MAX_MONTE_CARLO_TOKENS:
                raise PlanError(
                    f"--monte-carlo {a.monte_carlo} x --tokens {a.tokens} is more than this "
                    f"simulator does (at most {MAX_MONTE_CARLO_RUNS:,} runs and "
                    f"{MAX_MONTE_CARLO_TOKENS:,} simulated tokens)")
            out["monte_carlo"] = monte_carlo(a.layers, a.exit_layer, a.k, a.tokens,
                                             a.p_correct, runs=a.monte_carlo)
        _emit(a, out)
        return 0
    return _run(body, args)


def check_plan_size(seq_len: Any, what: str, tables: int = 1) -> None:
    """Refuse a TeraPipe plan whose ``(L+1) x (L+1)`` cost matrices (a few float64 copies,
    and one more per further cost table held at once: ``tables``, the batch sizes of a
    joint plan) would not fit in this machine's memory."""
    from exitlm.config import physical_memory  # lazy: loaded when the command runs

    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise PlanError(f"{what}: expected an integer >= 1, got {seq_len!r}")
    need = (4 + tables) * 8 * (seq_len + 1) ** 2
    total = physical_memory()
    if total is not None and need > total // 2:
        of = f" for {tables} batch sizes" if tables > 1 else ""
        raise PlanError(f"{what} {seq_len}: the plan's cost matrices{of} need about "
                        f"{need / 2**30:,.1f} GiB, more than half of this machine's "
                        f"{total / 2**30:,.1f} GiB")


MAX_PLAN_BATCH = 1024
"""The largest ``--batch`` of a joint batch x token plan (its knapsack is quadratic in it)."""


def _batch_profiles(prof: dict[str, Any], batch: int, seq_len: int, backward: bool,
                    where: str) -> list[dict[str, Any]]:
    """The profiles of batch sizes ``1..batch`` in ``prof["batch"]``, each for the profile's
    ``seq_len`` tokens, checked to fit in memory together."""
    found = prof.get("batch")
    if not isinstance(found, list) or len(found) < batch:
        raise PlanError(f"--batch {batch} needs a \"batch\" list with profiles for "
                        f"batch sizes 1..{batch} in the profile")
    for b, entry in enumerate(found[:batch]):
        if not isinstance(entry, dict):
            raise PlanError(f"{where}: batch[{b}] must be a JSON object (the profile of batch "
                            f"size {b + 1}), got {short_repr(entry)}")
        t = entry.get("t_noctx")
        if isinstance(t, list) and len(t) != seq_len:
            raise PlanError(f"{where}: batch[{b}].t_noctx has {len(t)} entries but seq_len is "
                            f"{seq_len}; every batch size's profile gives t(i, 0) for i = 1..L")
    check_plan_size(seq_len, "the profile's seq_len", batch * (2 if backward else 1))
    return found[:batch]


# ----- terapipe ------------------------------------------------------------------------------

def _perf(d: dict[str, Any], suffix: str, where: str, unit: str | None,
          warnings: list[str]) -> Any:
    """The Eq. 9 model of ``d``'s ``t_noctx<suffix>``/``ctx_coef<suffix>``, refused when it
    cannot support a plan (:func:`exitlm.plan.fit_check.check_model`); its warnings are
    added to ``warnings``."""
    from exitlm.plan.fit_check import (  # lazy: loaded when the command runs
        check_model,
        parse_samples,
    )
    from exitlm.plan.terapipe import PerfModel  # lazy: loaded when the command runs

    key = "t_noctx" + suffix
    if key not in d:
        raise PlanError(f"{where} has no {key!r}; add it (t(1)..t(L) of one stage)")
    pm = PerfModel(_numbers(d[key], key, where),
                   _numbers(d.get("ctx_coef" + suffix, [0, 0, 0, 0]), "ctx_coef" + suffix, where))
    measured = d.get("measured")
    samples = None
    if not suffix and isinstance(measured, dict) and "ctx_samples" in measured:
        samples = parse_samples(measured["ctx_samples"], where)
    name = f"{where} ({key})" if suffix else where
    warnings += [f"{name}: {w}" if suffix else w
                 for w in check_model(pm, name, unit, samples)]
    return pm


def _numbers(value: Any, key: str, where: str) -> tuple[float, ...]:
    """``value``, a profile's list of numbers under ``key``, as floats (a one-line
    :class:`PlanError` naming ``where`` and ``key`` for anything else)."""
    if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise PlanError(f"{where}: {key!r} must be a list of numbers, got {short_repr(value)}")
    return tuple(float(v) for v in value)


def _read_profile(path: str) -> Any:
    """The JSON of ``--profile`` (a regular file of at most 64 MiB), errors naming it."""
    text = read_text_file(path, 64 * 2**20, label=f"--profile {path}", expected="a JSON profile")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise PlanError(f"--profile {path}: invalid JSON ({err})") from None


def _cost(d: dict[str, Any], backward: bool, where: str, unit: str | None,
          warnings: list[str]) -> np.ndarray:
    c = _perf(d, "", where, unit, warnings).matrix()
    if backward:
        c = c + _perf(d, "_bwd", where, unit, warnings).matrix()
    return c


def _terapipe_text(out: dict[str, Any], unit: str | None) -> str:
    """The readable form of a TeraPipe plan: a line of totals, a table of slices, the
    latency against the best uniform slicing, and any warning about the cost model."""
    from exitlm.plan.fit_check import (  # lazy: loaded when the command runs
        format_time,
        time_column,
    )
    from exitlm.table import number, render  # lazy: loaded when the command runs

    header, scale = time_column(unit)
    rows, ctx = [], 0
    for k, (n, t) in enumerate(zip(out["slices"], out["slice_times"], strict=True)):
        rows.append([str(k + 1), f"{n:,}", f"{ctx:,}", number(t * scale)])
        ctx += n
    if len(rows) > 24:
        rows = [*rows[:20], ["...", "", "", ""], *rows[-3:]]
    uni = out["best_uniform"]
    lines = [
        f"TeraPipe plan: {out['seq_len']:,} tokens in {out['num_slices']} slice(s) over "
        f"{out['stages']} stage(s)",
        render(["slice", "tokens", "context", header], rows),
        f"latency (Eq. 5): {format_time(out['latency'], unit)}; slowest slice (t_max): "
        f"{format_time(out['tmax'], unit)}",
        f"best uniform slicing: {uni['num_slices']} slice(s), "
        f"{format_time(uni['latency'], unit)}; this plan is "
        f"{out['uniform_over_dp']:.2f}x faster",
        f"planner: {out['dp_evaluations']} DP evaluations in "
        f"{number(out['dp_seconds'] * 1e3)} ms",
    ]
    if out.get("plot"):
        lines.append(f"timeline: {out['plot']}")
    lines += [f"warning: {w}" for w in out.get("warnings", [])]
    return "\n".join(lines)


def _cmd_terapipe(args: argparse.Namespace) -> int:
    def body(a: argparse.Namespace) -> int:
        # lazy: loaded when the command runs
        from exitlm.plan.terapipe import best_uniform, plan_batch, plan_slices

        if a.profile:
            prof = _read_profile(a.profile)
            if not isinstance(prof, dict):
                raise PlanError(f"{a.profile} must hold a JSON object")
            if "t_noctx" in prof:
                _numbers(prof["t_noctx"], "t_noctx", a.profile)
        else:
            if not a.seq_len or not a.stages:
                raise PlanError("--model needs --seq-len L and --stages K")
            check_plan_size(a.seq_len, "--seq-len")
            from exitlm.plan.profile import profile_terapipe  # lazy: loaded when the command runs

            pm, raw = profile_terapipe(_load_config(a.model), a.seq_len, a.stages,
                                       repeats=a.repeats, threads=a.threads)
            prof = {"seq_len": a.seq_len, "stages": a.stages, "unit": "s",
                    "t_noctx": list(pm.t_noctx), "ctx_coef": list(pm.ctx_coef),
                    "measured": raw}
            if a.save_profile:
                _write_json(a.save_profile, prof)
        unit = prof.get("unit")
        if unit not in (None, "s", "ms"):
            raise PlanError(f"{a.profile}: \"unit\" must be \"s\" or \"ms\", got {unit!r}")
        warnings: list[str] = []
        stages = a.stages or prof.get("stages")
        check_plan_size(prof.get("seq_len", len(prof.get("t_noctx", []))),
                        "the profile's seq_len")
        if not stages:
            raise PlanError("the profile has no \"stages\"; pass --stages K")
        seq_len = int(prof.get("seq_len", len(prof.get("t_noctx", []))))
        if len(prof.get("t_noctx", [])) != seq_len:
            raise PlanError(f"t_noctx has {len(prof.get('t_noctx', []))} entries but seq_len "
                            f"is {seq_len}; give t(i, 0) for i = 1..L")
        t0 = time.perf_counter()
        if a.batch:
            batch = _batch_profiles(prof, a.batch, seq_len, a.backward,
                                    a.profile or "the profile of --model")
            costs = [_cost(batch[b], a.backward, f"batch[{b}]", unit, warnings)
                     for b in range(a.batch)]
            out = plan_batch(costs, a.batch, int(stages), a.epsilon, a.method)
            if not all(math.isfinite(float(x)) and x > 0
                       for x in (out["latency"], out["pipelined_latency"])):
                raise PlanError("the joint batch plan has a non-finite or non-positive "
                                "latency; the cost model cannot support a plan")
            out["dp_seconds"] = time.perf_counter() - t0
            out["warnings"] = warnings
            _emit(a, out)
            return 0
        cost = _cost(prof, a.backward, a.profile or "the profile of --model", unit, warnings)
        res = plan_slices(cost, int(stages), a.epsilon, a.method)
        dp_s = time.perf_counter() - t0
        from exitlm.plan.fit_check import check_plan  # lazy: loaded when the command runs

        check_plan(res, unit)
        uni = best_uniform(cost, int(stages))
        out = {"slices": res["slices"], "latency": res["latency"], "stages": int(stages),
               "seq_len": seq_len, "num_slices": res["num_slices"],
               "slice_times": res["slice_times"], "tmax": res["tmax"],
               "dp_seconds": dp_s, "dp_evaluations": res["dp_evaluations"],
               "best_uniform": {"latency": uni["latency"], "num_slices": uni["num_slices"]},
               "uniform_over_dp": uni["latency"] / res["latency"],
               "time_unit": unit or "profile units", "warnings": warnings}
        if a.plot:
            # lazy: loaded when the command runs
            from exitlm.plan.simulate import simulate, terapipe_schedule
            from exitlm.plan.timeline import draw_timeline  # lazy: loaded when the command runs

            def tf(ln: int, c: int) -> float:
                return float(cost[ln, c])

            sim = simulate(terapipe_schedule(res["slices"], int(stages), tf))
            out["plot"] = draw_timeline(sim, a.plot, f"TeraPipe slices, latency "
                                        f"{sim.makespan:.4g}")
        if a.json:
            _emit(a, out)
        else:
            print(_terapipe_text(out, unit))
        return 0
    return _run(body, args)


# ----- pipeline ------------------------------------------------------------------------------

def _load_config(name: str) -> Any:
    from exitlm.config import PRESETS, ModelConfig, preset  # lazy: loaded when the command runs

    if name in PRESETS:
        return preset(name)
    if os.path.exists(name):
        from exitlm.config import check_fits_in_memory  # lazy: loaded when the command runs
        from exitlm.io.st import read_json  # lazy: loaded when the command runs

        cfg = ModelConfig.from_dict(read_json(Path(name)), where=name)
        check_fits_in_memory(cfg, f"--model {name}")
        return cfg
    raise PlanError(f"--model {name!r} is neither a preset ({sorted(PRESETS)}) nor a file")


def _write_json(path: str, obj: Any) -> None:
    write_text_atomic(Path(path), json.dumps(obj, indent=2))


COOLDOWN_ROUNDS = 33
"""Simulations of one schedule that cool-down filling may run (``_order_cooldown``'s rounds
and the final one)."""


def check_simulation_size(a: argparse.Namespace, cap: int) -> None:
    """Refuse a pipeline simulation of more than :data:`MAX_SIMULATED_STEPS` stage steps:
    ``--stages`` x (``--microbatches`` + the bubble-filling microbatches, ``cap`` per filled
    part) x ``--token-slices``, times the simulations that cool-down ordering runs."""
    parts = {"none": 0, "part1": 1, "part2": 1, "both": 2}[a.fill]
    rounds = COOLDOWN_ROUNDS if a.fill in ("part2", "both") and a.schedule == "1f1b" else 1
    steps = a.stages * (a.microbatches + parts * cap) * a.token_slices * rounds
    if steps > MAX_SIMULATED_STEPS:
        fill = f" + {parts} x {cap} bubble-filling microbatches" if parts * cap else ""
        mbs = (f"(--microbatches {a.microbatches}{fill})" if fill
               else f"--microbatches {a.microbatches}")
        again = f", simulated {rounds} times to order the cool-down" if rounds > 1 else ""
        raise PlanError(
            f"--stages {a.stages} x {mbs} x --token-slices "
            f"{a.token_slices}{again} is more than the simulator does (at most "
            f"{MAX_SIMULATED_STEPS:,} stage steps)",
            hint="use fewer stages or microbatches" + (", or --fill none / part1" if parts
                                                        else ""))


def _cmd_pipeline(args: argparse.Namespace) -> int:
    def body(a: argparse.Namespace) -> int:
        # lazy: loaded when the command runs
        from exitlm.plan.simulate import simulate, training_ops, training_schedule

        p = a.stages
        check_simulation_size(a, 0)  # before a model loads: the filled bubbles only add
        notes: dict[str, Any] = {}
        n = _counts(a.exits_per_stage, p, "--exits-per-stage") if a.exits_per_stage \
            else (0,) * p
        costs = {k: OpCost() for k in ("IN", "BB", "EE", "FE")}
        if a.model:
            cfg = _load_config(a.model)
            if a.measure:
                from exitlm.plan.profile import profile_costs  # lazy: loaded when the command runs
                costs = profile_costs(cfg, p, a.seq_len, a.micro_batch, threads=1)
            else:
                from exitlm.plan.profile import analytic_costs  # lazy: loaded when the command runs
                costs = analytic_costs(cfg, p, a.seq_len, a.micro_batch, a.flops, a.bandwidth)
            if a.recommend is not None:
                rec = recommend_exits(cfg.num_layers, p, a.recommend)
                notes["recommendation"] = rec
                n = tuple(rec["exits_per_stage"])  # type: ignore[arg-type]
            elif not a.exits_per_stage and cfg.exit_layers:
                # lazy: loaded when the command runs
                from exitlm.plan.cost_model import exits_per_stage
                n = exits_per_stage(cfg.exit_layers, cfg.num_layers, p)
        elif not a.times:
            raise PlanError("give --times f_in,b_in,f_bb,b_bb,f_ee,b_ee,f_fe,b_fe or --model")
        if a.times:
            v = _floats(a.times, 8, "--times", "f_in,b_in,f_bb,b_bb,f_ee,b_ee,f_fe,b_fe")
            costs = {k: OpCost(v[2 * i], v[2 * i + 1], costs[k].m, costs[k].m_act)
                     for i, k in enumerate(("IN", "BB", "EE", "FE"))}
        if a.memory:
            v = _floats(a.memory, 8, "--memory", "m_in,m_in+,m_bb,m_bb+,m_ee,m_ee+,m_fe,m_fe+")
            costs = {k: OpCost(costs[k].f, costs[k].b, v[2 * i], v[2 * i + 1])
                     for i, k in enumerate(("IN", "BB", "EE", "FE"))}
        spec = PipelineSpec(p, a.microbatches, n, alpha=a.alpha,
                            deferred_exits=not a.no_defer, **costs)
        steps = stage_step_times(spec)
        mem = stage_memory(spec)
        if not all(math.isfinite(x) for st in steps for x in st) or \
                not all(math.isfinite(m["total"]) for m in mem):
            raise PlanError("the per-stage times or memory overflow (they are not finite); "
                            "give --times / --memory in a larger unit, or a smaller --alpha "
                            "or --exits-per-stage")
        f_max = max(f for f, _ in steps)
        b_max = max(b for _, b in steps)
        cap = bubble_fill_capacity(p, f_max, b_max) if b_max > 0 else 0
        check_simulation_size(a, cap)
        part2 = part2_backward_stages(p, f_max, b_max, cap) if b_max > 0 else []
        part1 = part1_forward_depths(n, cap)
        slices = (1,) * a.token_slices  # equal shares of a microbatch's time
        ratio = b_max / f_max if f_max > 0 and b_max > 0 else 1.0
        sched = training_schedule(spec, a.schedule, backward_forward_ratio=ratio, slices=slices)
        sim = simulate(training_ops(spec, sched))
        out: dict[str, Any] = {
            "time_per_iteration_bound": iteration_time_bound(spec),
            "time_per_iteration_simulated": sim.makespan,
            "schedule": a.schedule, "deferred_exits": spec.deferred_exits,
            "exits_per_stage": list(n),
            "stages": [{"stage": i + 1, "forward": steps[i][0], "backward": steps[i][1],
                        "busy": sim.busy[i], "idle": sim.idle[i], "memory": mem[i]}
                       for i in range(p)],
            "peak_memory": max(m["total"] for m in mem),
            "bubble_filling": {"f": f_max, "b": b_max, "max_inserted_microbatches": cap,
                               "part1_forward_depths": part1,
                               "part2_backward_stages": part2},
            "quantities": {k: vars(c) for k, c in costs.items()},
        }
        out.update(notes)
        fill = {"none": "none", "part1": "warmup", "part2": "cooldown", "both": "both"}[a.fill]
        if fill != "none":
            sched = training_schedule(spec, a.schedule, fill, backward_forward_ratio=ratio,
                                      slices=slices)
            sim = simulate(training_ops(spec, sched))
            out["bubble_filling"]["time_per_iteration_simulated"] = sim.makespan
        # the per-stage actions simulated: exactly what `exitlm train` executes with
        # parallel.schedule / bubble_fill / backward_forward_ratio / token_slices set alike
        out["actions"] = [" ".join(map(str, acts)) for acts in sched.actions]
        if a.plot:
            from exitlm.plan.timeline import draw_timeline  # lazy: loaded when the command runs
            out["plot"] = draw_timeline(sim, a.plot, f"{a.schedule.upper()} P={p} "
                                        f"M={a.microbatches}: {sim.makespan:.4g}")
        if not all(math.isfinite(x) for x in (sim.makespan,)):
            raise PlanError("simulation produced a non-finite time; check --times")
        _emit(a, out)
        return 0
    return _run(body, args)
