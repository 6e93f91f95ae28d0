"""Decoding across processes (EE-LLM Sec. 4; Megatron-style tensor parallelism).

* :mod:`.launch` - joining a job: processes exitlm starts itself (``torch.multiprocessing``
  spawn + gloo on 127.0.0.1) or the ones ``torchrun`` started; children are killed when one
  fails, and every transfer has a timeout.
* :mod:`.pipeline_ee` - pipeline-based early-exit inference: the model split by layer range
  into stages, one process each; an exited token is decided at once while the later stages
  keep running it to fill their KV caches (EE-LLM Sec. 4, Fig. 10).
* :mod:`.tp_decode` - tensor-parallel decoding: every rank holds a shard of a normally loaded
  model and runs the ordinary decoders on identical inputs.

The model itself never imports ``torch.distributed``; everything here wraps a built model.
"""
