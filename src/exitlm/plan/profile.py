"""Where the planners' numbers come from: analytic estimates for a :class:`ModelConfig`, or
timings of the real modules on the current device.

* :func:`analytic_costs` - EE-LLM Table 2 quantities from FLOP / byte counts (Narayanan et al.
  2021 FLOPs, Korthikanti et al. 2022 activation bytes, as EE-LLM App. A.3 suggests);
* :func:`profile_costs` - the same quantities measured on :class:`EarlyExitLM` pieces
  (time: median wall clock; activation memory: bytes autograd saves for backward);
* :func:`profile_terapipe` - TeraPipe Eq. 9 for one stage: ``t_fwd(i, 0)`` measured over slice
  lengths, ``t_ctx`` fitted from a subset of ``(i, j)`` using a KV cache that already holds
  ``j`` positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from exitlm.config import ExitConfig, ModelConfig
from exitlm.model.transformer import EarlyExitLM
from exitlm.plan.cost_model import OpCost, PlanError
from exitlm.plan.terapipe import PerfModel, fit_ctx_coef
from exitlm.progress import progress


def _per_stage(cfg: ModelConfig, stages: int) -> int:
    if stages < 1 or cfg.num_layers % stages:
        raise PlanError(f"--stages={stages} must divide num_layers={cfg.num_layers} "
                        "(EE-LLM App. A.3 assumes equal layers per stage)")
    return cfg.num_layers // stages


def _layer_params(cfg: ModelConfig) -> int:
    d, hd = cfg.dim, cfg.hdim
    attn = d * cfg.num_heads * hd + 2 * d * cfg.n_kv_heads * hd + cfg.num_heads * hd * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.hidden_dim
    return attn + mlp + 2 * d * (2 if cfg.norm == "layernorm" else 1)


def _layer_flops(cfg: ModelConfig, n_tok: int, seq: int) -> float:
    """Forward FLOPs of one layer on ``n_tok = b s`` tokens (matmuls; causal attention)."""
    d, hd, h = cfg.dim, cfg.hdim, cfg.num_heads
    proj = 2 * n_tok * (d * h * hd + 2 * d * cfg.n_kv_heads * hd + h * hd * d)
    attn = 2 * n_tok * seq * h * hd  # QK^T and AV, each 2 flops/MAC, halved for causality
    mlp = 2 * n_tok * (3 if cfg.mlp == "swiglu" else 2) * d * cfg.hidden_dim
    return float(proj + attn + mlp)


def _layer_act_bytes(cfg: ModelConfig, b: int, s: int) -> float:
    """Korthikanti et al. (2022) Eq. 1 activation bytes of one layer in 16-bit, no
    recomputation: ``sbh (34 + 5 a s / h)`` for a 4h GELU MLP; the MLP term generalised
    to hidden size F (``3 sbh + 4 sbF`` GELU, ``3 sbh + 6 sbF`` SwiGLU)."""
    h, a, f = cfg.dim, cfg.num_heads, cfg.hidden_dim
    attn = 11 * s * b * h + 5 * a * s * s * b
    mlp = 3 * s * b * h + (6 if cfg.mlp == "swiglu" else 4) * s * b * f
    return float(attn + mlp + 4 * s * b * h)


def analytic_costs(cfg: ModelConfig, stages: int, seq_len: int, micro_batch: int = 1,
                   flops_per_s: float = 1e12, bytes_per_s: float = 1e11,
                   bytes_per_param: float = 2.0) -> dict[str, OpCost]:
    """EE-LLM Table 2 quantities for ``cfg`` split into ``stages`` equal stages.

    Time = roofline ``max(FLOPs / flops_per_s, bytes / bytes_per_s)``; backward = 2 x forward
    FLOPs. The exit head follows ``cfg.exits.head`` (linear / mlp / block) with its own output
    matrix (a pipeline stage holds its own copy even when tied). Logits count 4 bytes/entry
    (fp32 softmax). Embedding matrices are untied (EE-LLM App. A.3 assumption).
    """
    per = _per_stage(cfg, stages)
    if seq_len < 1 or micro_batch < 1:
        raise PlanError("--seq-len and --micro-batch must be >= 1")
    b, s, d, v = micro_batch, seq_len, cfg.dim, cfg.vocab_size
    n = b * s

    def t(flops: float, nbytes: float) -> float:
        return max(flops / flops_per_s, nbytes / bytes_per_s)

    lay_p = _layer_params(cfg)
    bb_fl = per * _layer_flops(cfg, n, s)
    bb_p = per * lay_p
    head_p = d * v + d
    head_fl = 2.0 * n * d * v
    extra_p, extra_fl, extra_act = 0.0, 0.0, 0.0
    if cfg.exits.head == "mlp":
        extra_p = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.hidden_dim + d
        extra_fl = 2.0 * n * (3 if cfg.mlp == "swiglu" else 2) * d * cfg.hidden_dim
        extra_act = 3 * s * b * d + (6 if cfg.mlp == "swiglu" else 4) * s * b * cfg.hidden_dim
    elif cfg.exits.head == "block":
        extra_p, extra_fl = lay_p, _layer_flops(cfg, n, s)
        extra_act = _layer_act_bytes(cfg, b, s)
    logit_bytes = 4.0 * n * v + 2.0 * n * d
    in_p = v * d + (cfg.max_seq_len * d if cfg.pos == "learned" else 0)
    wb = bytes_per_param
    return {
        # embedding: a gather of n rows forward, a scatter-add backward (memory bound)
        "IN": OpCost(t(0.0, n * d * wb), t(0.0, 2 * n * d * wb), in_p * wb, n * d * 1.0),
        "BB": OpCost(t(bb_fl, bb_p * wb), t(2 * bb_fl, 2 * bb_p * wb), bb_p * wb,
                     per * _layer_act_bytes(cfg, b, s)),
        "EE": OpCost(t(head_fl + extra_fl, (head_p + extra_p) * wb),
                     t(2 * (head_fl + extra_fl), 2 * (head_p + extra_p) * wb),
                     (head_p + extra_p) * wb, logit_bytes + extra_act),
        "FE": OpCost(t(head_fl, head_p * wb), t(2 * head_fl, 2 * head_p * wb), head_p * wb,
                     logit_bytes),
    }


# ----- measurement ---------------------------------------------------------------------------

@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (timings on a shared CPU are far less
    noisy with 1 thread)."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> float:
    """Bytes of tensors autograd saves for backward while running ``fn`` (counted once per
    storage)."""
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        try:
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except RuntimeError:
            pass
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return float(sum(seen.values()))


def _fb(fwd: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float, float]:
    """(forward time, backward time, activation bytes) of a scalar-valued ``fwd``."""
    tf = _median_time(lambda: fwd(), repeats)

    def both() -> None:
        fwd().backward()

    tfb = _median_time(both, repeats)
    return tf, max(tfb - tf, 0.0), _saved_bytes(fwd)


def profile_costs(cfg: ModelConfig, stages: int, seq_len: int, micro_batch: int = 1,
                  repeats: int = 3, device: str = "cpu",
                  threads: int | None = None) -> dict[str, OpCost]:
    """Measure EE-LLM Table 2 quantities on the real modules (random weights, fp32).

    BB is ``L/P`` consecutive :class:`Block` s; EE is one exit head of ``cfg.exits`` plus the
    cross-entropy loss; FE is the final norm + LM head + loss; IN is the embedding.
    """

    per = _per_stage(cfg, stages)
    exits = dataclasses.replace(cfg.exits, layers=(1,), every_layer=False)
    small = cfg.replace(num_layers=per + 1, exits=exits, tie_embeddings=False,
                        max_seq_len=max(cfg.max_seq_len, seq_len))
    torch.manual_seed(0)
    model = EarlyExitLM(small).to(device)
    b, s = micro_batch, seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s), device=device)
    target = torch.randint(0, cfg.vocab_size, (b * s,), device=device)
    h0 = torch.randn(b, s, cfg.dim, device=device, requires_grad=True)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target)

    with _threads(threads):
        res = {
            "IN": _fb(lambda: model.embed(tokens).square().mean(), repeats),
            "BB": _fb(lambda: model.run_layers(h0, 0, per).square().mean(), repeats),
            "EE": _fb(lambda: loss(model.exit_logits(h0, 1)), repeats),
            "FE": _fb(lambda: loss(model.final_logits(h0)), repeats),
        }

    def pbytes(mods: Sequence[torch.nn.Module]) -> float:
        return float(sum(p.numel() * p.element_size() for m in mods for p in m.parameters()))

    mem = {
        "IN": pbytes([model.embed_tokens] + ([model.embed_positions]
                                             if model.embed_positions is not None else [])),
        "BB": pbytes(list(model.layers[:per])),
        "EE": pbytes([model.exits["1"]]) + (0.0 if cfg.exits.output == "own"
                                            else pbytes([model.lm_head])),
        "FE": pbytes([model.norm, model.lm_head]),
    }
    return {k: OpCost(f, bw, mem[k], act) for k, (f, bw, act) in res.items()}


def profile_terapipe(cfg: ModelConfig, seq_len: int, stages: int,
                     lengths: Sequence[int] | None = None, repeats: int = 3,
                     device: str = "cpu", threads: int | None = None,
                     ) -> tuple[PerfModel, dict[str, object]]:
    """Fit TeraPipe Eq. 9 for one stage (``ceil(L_layers / K)`` layers) of ``cfg``.

    ``t_fwd(i, 0)`` is measured at ``lengths`` (default: all ``1..L`` for ``L <= 128``,
    otherwise ~40 lengths, geometric plus evenly spaced) and linearly interpolated in
    between; ``t_ctx`` is fitted on a 4 x 4 grid of ``(i, j)``. Returns the model and the raw
    measurements.
    """

    if stages < 1 or seq_len < 1:
        raise PlanError("--seq-len and --stages must be >= 1")
    per = max(1, -(-cfg.num_layers // stages))
    small = cfg.replace(num_layers=per, exits=ExitConfig(),
                        max_seq_len=max(cfg.max_seq_len, seq_len))
    torch.manual_seed(0)
    model = EarlyExitLM(small).to(device).eval()
    big = seq_len
    if lengths is None:
        if big <= 128:
            lengths = list(range(1, big + 1))
        else:
            geo = np.unique(np.geomspace(1, big, 24).round().astype(int))
            lin = np.linspace(1, big, 16).round().astype(int)
            lengths = sorted(set(geo.tolist()) | set(lin.tolist()) | {big})
    lengths = sorted({int(x) for x in lengths if 1 <= int(x) <= big})

    def run(i: int, j: int) -> float:
        h_ctx = torch.randn(1, j, cfg.dim, device=device)
        h = torch.randn(1, i, cfg.dim, device=device)
        pos = torch.arange(j, j + i, device=device)[None]

        def step() -> None:
            cache = model.new_cache(1, big)
            if j:
                model.run_layers(h_ctx, 0, per, positions=torch.arange(j, device=device)[None],
                                 cache=cache)
            model.run_layers(h, 0, per, positions=pos, cache=cache)

        def ctx_only() -> None:
            cache = model.new_cache(1, big)
            if j:
                model.run_layers(h_ctx, 0, per, positions=torch.arange(j, device=device)[None],
                                 cache=cache)

        return max(_median_time(step, repeats) - (_median_time(ctx_only, repeats) if j else 0),
                   0.0)

    ii = sorted({max(1, big // q) for q in (16, 8, 4, 2)})
    pairs = {i: [j for j in sorted({max(1, (big - i) // q) for q in (8, 4, 2, 1)})
                 if i + j <= big] for i in ii}
    with torch.no_grad(), _threads(threads):
        t_meas = []
        with progress(f"profiling t(i, 0) of one stage ({per} layers)",
                      total=len(lengths), unit="length") as bar:
            for i in lengths:
                t_meas.append(run(i, 0))
                bar.update(1)
        samples = []
        with progress("profiling the context cost t_ctx(i, j)",
                      total=sum(len(js) for js in pairs.values()), unit="pair") as bar:
            for i, js in pairs.items():
                t0 = run(i, 0)
                for j in js:
                    samples.append((i, j, run(i, j) - t0))
                    bar.update(1)
    t_all = np.interp(np.arange(1, big + 1), lengths, t_meas)
    coef = fit_ctx_coef(samples) if len(samples) >= 4 else (0.0, 0.0, 0.0, 0.0)
    return PerfModel(tuple(float(x) for x in t_all), coef), {
        "lengths": lengths, "t_measured": t_meas, "ctx_samples": samples,
        "layers_per_stage": per}
