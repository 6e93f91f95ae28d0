"""Early-exit decoding: confidence exits (EE-LLM), fixed-layer exit (LayerSkip), state copying.

Three ways to emit a token before the last layer, chosen by :class:`EarlyExitOptions`:

* ``kv="recompute"`` (default; EE-LLM Sec. 4, App. D.3): at each checked exit in order, emit
  the token when the exit's maximum probability reaches ``threshold``. Keys/values the exited
  token skipped are recomputed in the next forward (:mod:`exitlm.infer.kv_recompute`), so the
  model never attends to an approximate entry: with ``threshold=1.0`` the output is exactly
  greedy decoding, and for any threshold it equals a cache-free full-prefix reference under the
  same exit rule. The *predictions* made at early exits are of course the exits' own.
* ``exit_layer=E`` (LayerSkip Sec. 4.2): every token runs the first ``E`` layers and leaves
  through exit ``E`` (:class:`~exitlm.infer.autoregressive.DepthDecoder`); layers past ``E``
  are never run, so no KV is missing. **Lossy**: this is a shallower model.
* ``kv="copy"`` (CALM-style state propagation, EE-LLM Sec. 4 "state propagation"): an exited
  token's hidden state at its exit is copied up to every skipped layer and only that layer's
  key/value projections are computed from it. **Lossy**: later tokens attend to approximate
  keys/values, so even the full-depth predictions drift. Offered for comparison only.
* ``kv="pipeline"`` (EE-LLM Sec. 4, pipeline-based inference): the model split into
  ``stages`` processes by layer range; an exited token is decided at once and the later
  stages keep running it, filling their KV caches (an executor of its own,
  :mod:`exitlm.infer.executors.pipeline`).
  Same tokens as ``recompute`` under the same exit decisions; a step carries every running
  sequence, each row deciding on its own.

Layer evaluations (``SequenceResult.layer_evaluations``) count token x layer passes through
transformer layers, recomputation included; the copy mode's projections are not counted.
"""

from __future__ import annotations

from exitlm.config import ConfigError
from exitlm.infer.autoregressive import DepthDecoder
from exitlm.infer.decoder import Decoder
from exitlm.infer.kv_recompute import CopyDecoder, RecomputeDecoder
from exitlm.infer.strategy_options import EarlyExitOptions
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.runner import Runner


def resolve_checks(model: EarlyExitLM, opts: EarlyExitOptions) -> tuple[int, ...]:
    """The exits checked (see :attr:`EarlyExitOptions.exit_layers`), validated."""
    num_layers = model.num_layers
    if opts.exit_layers is not None:
        checks = opts.exit_layers
    elif model.config.exits.layers:
        checks = model.config.exits.layers
    elif model.config.exits.every_layer:
        checks = tuple(sorted({max(1, num_layers * k // 4) for k in (1, 2, 3)} - {num_layers}))
    else:
        raise ConfigError(
            "the model has no early exits; load it with exits (e.g. "
            "load_model(..., exits=ExitConfig(every_layer=True))) or use strategy 'ar'"
        )
    for e in checks:
        if e >= num_layers:
            raise ConfigError(f"exit_layers: {e} is the final output, not an early exit; "
                              f"early exits lie in [1, {num_layers - 1}]")
        model.exit_route(e, setting="exit_layers:")
    return tuple(checks)


def early_exit_decoder(runner: Runner, options: EarlyExitOptions) -> Decoder:
    """The decoder that ``options`` asks for (fixed exit, recomputation or state copying)."""
    model = runner.model
    if options.exit_layer is not None:
        return DepthDecoder(runner, options, options.exit_layer)
    checks = resolve_checks(model, options)
    if options.kv == "copy":
        if any(model.exit_route(e).has_block for e in checks):
            raise ConfigError("kv='copy' does not support block exit heads; use kv='recompute'")
        return CopyDecoder(runner, options, checks)
    if options.kv == "pipeline":
        raise ConfigError("kv='pipeline' decodes on pipeline stages: an engine over a "
                          "PipelineExecutor (exitlm.infer.executors; generate() and Engine "
                          "start one for these options)")
    return RecomputeDecoder(runner, options, checks)
