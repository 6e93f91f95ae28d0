"""Training layouts: parallelism applied to a built model from outside it (the model never
imports ``torch.distributed``; torchtitan's "parallelize after build"):

* :mod:`.dims` - the ``parallel`` config section and the validated ``pp x dp x tp`` grid;
* :mod:`.groups` - device choice, process groups with ``parallel.timeout_s``, the DTensor mesh;
* :mod:`.layout` - ``parallelize``: one process, DDP, FSDP, tensor x data, pipeline x tensor x
  data parallelism behind one interface the trainer uses;
* :mod:`.tensor` - tensor parallelism with DTensor, vocabulary-parallel exits (EE-LLM Sec. 3);
* :mod:`.grads`, :mod:`.memory` - gradient averaging / clipping over shards; activation bytes;
* :mod:`.pipeline` - EE-LLM's pipeline parallelism.

Heartbeats and point-to-point transfers with timeouts live in :mod:`exitlm.comm`; pipeline
schedules in :mod:`exitlm.plan.schedule`.
"""
