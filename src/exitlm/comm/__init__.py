"""Processes and the transports between them, for decoding and training alike.

* :mod:`.launch` - joining a job: processes exitlm starts itself (``torch.multiprocessing``
  spawn + gloo on 127.0.0.1) or the ones ``torchrun`` started; children are killed when one
  fails;
* :mod:`.rendezvous` - meeting the other ranks within a deadline, without c10d's logs;
* :mod:`.lifeline` - spawned workers end when the process that started them dies;
* :mod:`.health` - heartbeats that name a stopped rank when a collective times out;
* :mod:`.p2p` - ``isend`` / ``irecv`` with timeouts (gloo, NCCL);
* :mod:`.shm`, :mod:`.shm_p2p`, :mod:`.native_reduce`, :mod:`.native_channel` - ranks of one
  machine: rank-order sums and gathers, and point-to-point channels, through shared memory
  (``reduce.c``, ``channel.c``).
"""
