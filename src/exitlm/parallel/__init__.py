"""Parallelism applied to a built model from outside it (the model never imports
``torch.distributed``): the process grid (:mod:`exitlm.parallel.dims`) and pipeline
parallelism (:mod:`exitlm.parallel.pipeline`)."""
