"""Decoding across processes (EE-LLM Sec. 4; Megatron-style tensor parallelism): the process
topologies an engine's decoder can run on.

* :mod:`.pipeline` / :mod:`.pipeline_stage` - pipeline-based early-exit inference: the model
  split by layer range into stages, one process each; an exited token is decided at once
  while the later stages keep running it to fill their KV caches (EE-LLM Sec. 4, Fig. 10).
* :mod:`.tp_shard` / :mod:`.tp` - tensor-parallel decoding: every rank holds a shard of a
  normally loaded model and runs the ordinary decoders on identical inputs.

Processes are started and joined by :mod:`exitlm.comm`. The model itself never imports
``torch.distributed``; everything here wraps a built model.
"""
