"""The runtime: how a model's forward runs, apart from any decoding strategy.

:func:`prepare` builds the :class:`~exitlm.runtime.runner.Runner` for a model - the eager
runner, :class:`~exitlm.runtime.native.NativeRunner` on CPU with exitlm's native kernels,
:class:`~exitlm.runtime.graphs.GraphRunner` on CUDA - without changing the model (no class
swapped, no method patched: several engines may share one model). Decoders call the runner's
primitives (:mod:`exitlm.runtime.runner`) and never ask which one they have.
"""

from __future__ import annotations

from typing import Literal

from exitlm.kernels import native as native_lib
from exitlm.model.transformer import EarlyExitLM
from exitlm.runtime.graphs import GraphRunner, graphs_wanted
from exitlm.runtime.native import NativeRunner
from exitlm.runtime.products import Products
from exitlm.runtime.runner import Chain, Runner, Segments

Backend = Literal["auto", "eager", "native", "graphs", "fused", "static"]
BACKENDS: tuple[str, ...] = ("auto", "eager", "native", "graphs", "fused", "static")
"""``auto``: the fastest for the model's device; ``eager``: plain torch (the reference);
``native``: the CPU kernels (needs a C compiler); ``graphs``: CUDA graphs; ``fused``: CUDA
graphs of layer steps compiled by ``torch.compile``'s inductor (:mod:`exitlm.runtime.fused`;
off CUDA, the compiled static code without graphs); ``static``: the CUDA-graph code run
eagerly (any device: what the CPU tests check)."""


def prepare(model: EarlyExitLM, *, backend: Backend = "auto", pack_rows: bool = False
            ) -> Runner:
    """The runner of ``model`` (see the module docstring). ``pack_rows`` prepares CPU
    products of several rows at once (batches, verification, recomputation) from the start;
    an engine asks for it later when it needs it (:meth:`Runner.enable_row_products`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown runtime backend {backend!r}; choose one of {BACKENDS}")
    device = model.embed_tokens.weight.device
    if backend == "auto":
        if device.type == "cuda":
            backend = "graphs" if graphs_wanted() else "eager"
        elif device.type == "cpu":
            backend = "native" if native_lib.library() is not None else "eager"
        else:
            backend = "eager"
    if backend == "graphs":
        return GraphRunner(model)
    if backend == "fused":
        return GraphRunner(model, capture=device.type == "cuda", fuse="inductor")
    if backend == "static":
        return GraphRunner(model, capture=False)
    if device.type != "cpu":
        return Runner(model)
    if backend == "native":
        lib = native_lib.library()
        if lib is None:
            raise RuntimeError(f"backend 'native': "
                               f"{native_lib.unavailable_reason()}")
        return NativeRunner(model, lib, pack_rows=pack_rows)
    return Runner(model, Products(model, pack_rows=pack_rows))


__all__ = ["BACKENDS", "Chain", "GraphRunner", "NativeRunner", "Runner", "Segments", "prepare"]
