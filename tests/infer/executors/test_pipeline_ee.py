"""Pipeline-based early-exit inference (EE-LLM Sec. 4) in real gloo processes: token for token
the same as KV recomputation under the same threshold, and greedy decoding at 1.0."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from _ee_models import ee_model, random_prompts
from _stall import kill_all, stall_at
from exitlm.config import ConfigError
from exitlm.infer import generate
from exitlm.infer.early_exit import EarlyExitOptions
from exitlm.infer.executors.pipeline import PipelineExecutor, stage_bounds
from exitlm.runtime import prepare

STEPS = 24
TIMEOUT_S = 4.0


def _run(model: Any, prompt: list[int], **kw: object) -> tuple[list[int], list[int]]:
    res = generate(model, None, [prompt], max_new_tokens=STEPS, ignore_eos=True, threads=1,
                   **kw)
    return res.sequences[0].token_ids, res.sequences[0].exit_layers


def _run_batch(model: Any, prompts: list[list[int]], **kw: object
               ) -> list[tuple[list[int], list[int]]]:
    res = generate(model, None, prompts, max_new_tokens=STEPS, ignore_eos=True, threads=1,
                   **kw)
    return [(s.token_ids, s.exit_layers) for s in res.sequences]


@pytest.mark.parametrize(("kind", "stages"), [("linear", 2), ("block", 3), ("layerskip", 4),
                                              ("gpt2-mlp", 2)])
def test_pipeline_equals_recompute(kind: str, stages: int) -> None:
    torch.set_num_threads(1)
    if kind == "layerskip":
        model = ee_model(every_layer=True)
        checks = {"exit_layers": (1, 2, 3)}
    else:
        model = ee_model("mlp" if kind == "gpt2-mlp" else kind, gpt2=kind == "gpt2-mlp")
        checks = {}
    torch.manual_seed(1)
    prompts = random_prompts()
    early = mixed = 0
    with torch.inference_mode(), PipelineExecutor(prepare(model), stages) as pipe:
        for thr, pending in ((0.5, 8), (0.7, 2), (1.0, 8)):
            for p in prompts:
                ref = _run(model, p, strategy="early-exit", threshold=thr, max_pending=pending,
                           **checks)
                got = _run(pipe, p, strategy="early-exit", threshold=thr, max_pending=pending,
                           kv="pipeline", **checks)
                assert got == ref, (kind, stages, thr, p)
                early += sum(layer < model.num_layers for layer in got[1])
                if thr == 1.0:
                    assert got[0] == _run(model, p, strategy="ar")[0]
            # all prompts (different lengths) as one batch: every row decides on its own
            ref_b = _run_batch(model, prompts, strategy="early-exit", threshold=thr,
                               max_pending=pending, **checks)
            got_b = _run_batch(pipe, prompts, strategy="early-exit", threshold=thr,
                               max_pending=pending, kv="pipeline", **checks)
            assert got_b == ref_b, (kind, stages, thr, "batch")
            if thr == 1.0:
                assert [t for t, _ in got_b] == [t for t, _ in _run_batch(model, prompts,
                                                                         strategy="ar")]
            else:  # rows of one step exited at different layers
                mixed += any(len({layers[i] for _, layers in got_b}) > 1
                             for i in range(1, STEPS))
    assert early > 10  # the thresholds really exit early
    assert mixed  # and a batch's rows really decide at different layers in one step


def _engine_run(model: Any, kv: str, requests: list[dict[str, Any]],
                max_batch: int) -> list[tuple[list[int], list[int]]]:
    """Decode ``requests`` (prompt, max_new_tokens, threshold) with continuous batching:
    at most ``max_batch`` rows, later requests join as earlier ones leave."""
    from exitlm.infer.engine import Engine
    from exitlm.infer.options import SamplingOptions

    eng = Engine(model, None, "early-exit", EarlyExitOptions(kv=kv, max_pending=3),  # type: ignore[arg-type]
                 max_batch=max_batch, threads=1)
    try:
        reqs = [eng.submit(r["prompt"], SamplingOptions(max_new_tokens=r["new"],
                                                        ignore_eos=True),
                           threshold=r["threshold"]) for r in requests]
        eng.run()
    finally:
        eng.close()
    return [(list(r.token_ids), list(r.exit_layers)) for r in reqs]


@pytest.mark.parametrize(("kind", "stages"), [("linear", 3), ("block", 2)])
def test_continuous_batching_equals_recompute(kind: str, stages: int) -> None:
    """Requests of different prompt lengths, lengths and thresholds join and leave a running
    batch (the engine compacts its rows; the stages must follow): every request gets the
    tokens and exit layers recomputation gives it under the same schedule."""
    torch.set_num_threads(1)
    model = ee_model(kind)
    torch.manual_seed(2)
    prompts = random_prompts(sizes=(5, 9, 3, 7, 4))
    requests = [{"prompt": p, "new": n, "threshold": t} for p, n, t in
                zip(prompts, (20, 6, 14, 9, 17), (0.5, 0.7, 1.0, 0.4, 0.6), strict=True)]
    with torch.inference_mode(), PipelineExecutor(prepare(model), stages) as pipe:
        ref = _engine_run(model, "recompute", requests, max_batch=3)
        got = _engine_run(pipe, "pipeline", requests, max_batch=3)
    assert got == ref
    assert [len(t) for t, _ in got] == [r["new"] for r in requests]
    assert any(layer < model.num_layers for _, layers in got for layer in layers)


def test_sampling_and_logprobs_match() -> None:
    torch.set_num_threads(1)
    model = ee_model("linear")
    p = random_prompts()[0]
    kw = {"strategy": "early-exit", "threshold": 0.5, "temperature": 0.8, "seed": 3,
          "max_new_tokens": STEPS, "ignore_eos": True, "logprobs": 2, "threads": 1}
    batch = [p, *random_prompts(sizes=(8, 2))]
    with torch.inference_mode():
        ref_all = generate(model, None, batch, **kw).sequences
        got_all = generate(model, None, batch, kv="pipeline", stages=2, **kw).sequences
    assert len(got_all) == 3
    for got, ref in zip(got_all, ref_all, strict=True):  # each row samples with its own seed
        assert got.token_ids == ref.token_ids and got.exit_layers == ref.exit_layers
        # fp32 summation order: recomputation runs deep layers of exited tokens batched with
        # the next token, the pipeline one token at a time (module docstring)
        assert [t.logprob for t in got.logprobs] == pytest.approx(
            [t.logprob for t in ref.logprobs], abs=1e-5)


def test_bad_stage_settings() -> None:
    assert stage_bounds(8, 3) == [(0, 3), (3, 6), (6, 8)]
    with pytest.raises(ConfigError, match="--stages 5"):
        stage_bounds(4, 5)
    with pytest.raises(ConfigError, match="--stages 2 applies only to --kv pipeline"):
        EarlyExitOptions(stages=2)
    model = ee_model("linear")
    with pytest.raises(ConfigError, match="--stages 9"):
        generate(model, None, [[1, 2]], strategy="early-exit", kv="pipeline", stages=9)


def test_dead_stage_is_an_error_not_a_hang() -> None:
    import time

    from exitlm.comm.health import ParallelError

    torch.set_num_threads(1)
    model = ee_model("linear")
    start = time.monotonic()
    with pytest.raises(ParallelError), PipelineExecutor(prepare(model), 2,
                                                        timeout_s=30) as pipe:
        group = pipe.group
        assert group.workers is not None
        group.workers.ctx.processes[0].kill()
        generate(pipe, None, [[1, 2, 3]], strategy="early-exit", kv="pipeline",
                 max_new_tokens=8, threads=1)
    assert time.monotonic() - start < 30
    assert not any(p.is_alive() for p in group.workers.ctx.processes)


def test_idle_pipeline_outlives_its_timeout() -> None:
    """A pipeline that waits between requests longer than its transfer timeout (a server with
    no traffic) still serves the next request: stages wait for commands without a deadline
    (they used to time out, exit, and leave stage 0 with a closed connection)."""
    import time

    torch.set_num_threads(1)
    model = ee_model("linear")
    kw = {"strategy": "early-exit", "kv": "pipeline", "threshold": 0.5, "max_new_tokens": 6,
          "ignore_eos": True, "threads": 1}
    with torch.inference_mode(), PipelineExecutor(prepare(model), 3, timeout_s=1.5) as pipe:
        first = generate(pipe, None, [[1, 2, 3]], **kw).sequences[0].token_ids
        time.sleep(3.0)
        assert pipe.group.workers is not None
        assert all(p.is_alive() for p in pipe.group.workers.ctx.processes)
        again = generate(pipe, None, [[1, 2, 3]], **kw).sequences[0].token_ids
    assert again == first and len(first) == 6


def test_sends_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo calls a send complete only once it is waited on: every step waits for the sends of
    the steps before it (they used to pile up with their tensors for the pipeline's lifetime,
    memory growing with every token). Stages on one machine use shared memory unless told
    otherwise: this is the transport of stages on several machines."""
    monkeypatch.setenv("EXITLM_SHM", "0")
    torch.set_num_threads(1)
    model = ee_model("linear")
    kw = {"strategy": "early-exit", "kv": "pipeline", "threshold": 0.5, "max_new_tokens": 30,
          "ignore_eos": True, "threads": 1}
    with torch.inference_mode(), PipelineExecutor(prepare(model), 2) as pipe:
        generate(pipe, None, [[1, 2, 3]], **kw)
        generate(pipe, None, [[4, 5], [6, 7, 8]], **kw)
        assert len(pipe.group.links.p2p.pending) <= 2  # one step's command header and rows


def test_several_prompts_batched_through_three_stages() -> None:
    torch.set_num_threads(1)
    model = ee_model("linear")
    prompts = random_prompts()
    kw = {"strategy": "early-exit", "threshold": 0.5, "max_new_tokens": 10, "ignore_eos": True,
          "threads": 1}
    with torch.inference_mode():
        ref = generate(model, None, prompts, **kw)
        got = generate(model, None, prompts, kv="pipeline", stages=3, **kw)
    assert [s.token_ids for s in got.sequences] == [s.token_ids for s in ref.sequences]
    assert got.options["stage_layers"] == [[1, 2], [3, 3], [4, 4]]



WAITED = "rank {} did not complete within 4 s (--dist-timeout)"


@pytest.mark.parametrize(("stages", "stalled", "call", "own", "threshold", "waited"), [
    (2, 1, 1, False, 1.0, WAITED.format(1)),
    (3, 2, 4, False, 1.0, WAITED.format(2)),
    # stage 0 waits for the last stage, which waits for the stopped middle one
    (3, 1, 4, True, 1.0, WAITED.format(2)),
    # every token exits at stage 0, nobody waits for the last stage's decision: stage 1 waits
    # for the stopped stage to take its sends, stage 0 for stage 1 to take its own
    (3, 2, 4, False, 0.0, "rows table to rank 1 did not complete within 4 s"),
], ids=["only-later-stage-at-prefill", "last-stage-mid-decoding",
        "middle-stage-decoder-owned-pipeline", "last-stage-noticed-by-backpressure"])
def test_stalled_stage_is_named_and_cleaned_up(monkeypatch: pytest.MonkeyPatch, stages: int,
                                               stalled: int, call: int, own: bool,
                                               threshold: float, waited: str) -> None:
    """A stage that stops answering but stays alive (SIGSTOP) ends the job with a
    ParallelError naming its rank, not a hang, and no stage process outlives the job (also
    when the engine started the pipeline itself and closes it in its cleanup)."""
    from exitlm.comm.health import ParallelError
    from exitlm.infer import executors

    torch.set_num_threads(1)
    model = ee_model("linear")
    pids = stall_at(monkeypatch, call, stalled)
    with_timeout = functools.partial(PipelineExecutor, timeout_s=TIMEOUT_S)
    monkeypatch.setattr(executors, "PipelineExecutor", with_timeout)  # what engines start
    # threshold 1.0: every token needs the last stage's decision; 0.0: none does
    kw: dict[str, Any] = {"strategy": "early-exit", "kv": "pipeline", "threshold": threshold,
                          "max_pending": 100, "max_new_tokens": 12, "ignore_eos": True,
                          "threads": 1}
    try:
        with pytest.raises(ParallelError) as info:
            if own:
                generate(model, None, [[1, 2, 3]], stages=stages, **kw)
            else:
                with with_timeout(prepare(model), stages) as pipe:
                    generate(pipe, None, [[1, 2, 3]], **kw)
    finally:
        left = kill_all(pids)  # never leave a stopped process behind, even on failure
    assert len(pids) == stages - 1  # the stage really was stopped
    msg = str(info.value)
    assert waited in msg and f"rank {stalled} (stopped)" in msg, msg
    assert not left, "a stage process outlived the job"
