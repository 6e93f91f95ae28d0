"""Pipeline-parallel early-exit training on torch.distributed point-to-point operations.

* :mod:`.stage` - cut a model into stages by layer range; which stage owns which exit and
  which parameters (EE-LLM App. A.2);
* :mod:`.slices` - keys/values of earlier token slices as autograd leaves;
* :mod:`.executor` - runs one step's actions (:mod:`exitlm.plan.schedule`): EE-LLM's
  ``L_i + <g_i, x_i>`` backward (Eq. 2), over :mod:`exitlm.comm.p2p`;
* :mod:`.engine` - a stage in a step: tensor parallelism inside it, gradient
  synchronisation (tied weights, data parallel), clipping.
"""
