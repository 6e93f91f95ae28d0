"""Pipeline-parallel early-exit training on torch.distributed point-to-point operations.

* :mod:`.stage` - cut a model into stages by layer range; which stage owns which exit and
  which parameters (EE-LLM App. A.2);
* :mod:`.schedule` - per-stage action lists: GPipe, 1F1B, bubble filling (EE-LLM App. C.2),
  token slices (TeraPipe Sec. 3); a checker that proves a schedule cannot deadlock;
* :mod:`.slices` - keys/values of earlier token slices as autograd leaves;
* :mod:`.p2p` - ``isend``/``irecv`` with timeouts;
* :mod:`.executor` - runs one step's actions: EE-LLM's ``L_i + <g_i, x_i>`` backward (Eq. 2);
* :mod:`.engine` - a stage in a step: tensor parallelism inside it, gradient
  synchronisation (tied weights, data parallel), clipping.
"""
