"""Where PPD's sub-processes run (PPD Alg. 2 lines 17-29): one :class:`Branches` per decoder.

Every branch is the same primitive - a candidate token at position ``p + 1`` through layers
``[0, m)`` (``m = d - d_bar``), a chain of no draft
(:meth:`~exitlm.runtime.runner.Runner.chain`) on the branch's own cache - run somewhere else
than the main token's remaining layers:

* :class:`SerialBranches` - one after the other on the calling thread (``--no-parallel``: no
  overlap; the same tokens);
* :class:`ThreadBranches` - worker threads (CPU: torch releases the GIL inside its kernels only,
  so a small model's branches mostly wait for the main thread);
* :class:`StreamBranches` - each branch on its own CUDA stream, launched from the calling
  thread; a graph runner replays its programs there with a private memory pool;
* a spawned worker process on keys/values in shared memory (CPU: processes overlap where
  threads do not), which its executor gives the decoder
  (:mod:`exitlm.infer.executors.ppd_worker`).

**KV sharing.** Branches read the prefix keys/values of layers ``[0, m)``, which the main
token has written for every position ``<= p`` before the fork and never touches during it (it
writes only layers ``>= d_bar >= m``). Each branch owns a cache of those ``m`` layers; after
every token the new prefix entry (position ``p``, or the confirmed branch's ``p + 1``) is copied
into the others (:meth:`Branches.share`, :meth:`Branches.adopt`): ``O(m)`` small copies per
token, no prefix is ever copied twice.

*Offloaded prediction* (:attr:`Branches.predicts`): threads and the worker process also make
the early prediction itself - exit ``d_bar``'s top-``k`` - so that projection, several layers'
worth of work over a large vocabulary, is not on the main token's path, which Theorem 4.1
assumes it is not.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from exitlm.model.kv_cache import KVCache
from exitlm.runtime.runner import Runner


def branch(runner: Runner, cache: KVCache, token: torch.Tensor, p: int, m: int
           ) -> torch.Tensor:
    """One PPD sub-process (Alg. 2 line 23): candidate ``token`` ``(1,)`` at position ``p``
    through layers ``[0, m)`` on a one-row ``cache`` - a chain of no draft
    (:meth:`~exitlm.runtime.runner.Runner.chain`); the hidden state ``(1, 1, D)``."""
    cache.lengths = torch.tensor([p])
    return runner.chain(token, cache, 0, m).hidden


class Branches:
    """``k`` branches of ``m`` layers (see the module docstring); subclasses say where they
    run. ``predicts``: the early prediction is made on the branches' side (:meth:`predict`);
    otherwise the caller forks with candidates it chose (:meth:`fork`)."""

    predicts = False

    def __init__(self, runner: Runner, m: int, k: int, head: tuple[int, int]) -> None:
        self.runner, self.m, self.k = runner, m, k
        self.d_bar, self.vocab = head
        self.caches: list[KVCache] = []

    # ----- the prefix the branches read ---------------------------------------------------------
    def start(self, main: KVCache, prompt: int, capacity: int) -> None:
        """A new sequence in ``main`` with ``prompt`` positions: branch caches of at least
        ``capacity`` positions, holding the prompt's entries of layers ``[0, m)``."""
        if not self.caches or self.caches[0].max_seq_len < capacity:
            cfg = self.runner.config
            for c in self.caches:
                self.runner.release(c)
            self.caches = [KVCache(self.m, 1, capacity, cfg.n_kv_heads, cfg.hdim,
                                   dtype=main.dtype, device=self.runner.device)
                           for _ in range(self.k)]
        for c in self.caches:
            c.copy_from(main, self.m, slice(0, prompt))

    def main_view(self, main: KVCache) -> KVCache:
        """The cache the main token runs on (its own, unless the branches' storage holds its
        lower layers)."""
        return main

    def share(self, main: KVCache, p: int) -> None:
        """Main wrote position ``p`` of layers ``[0, m)``: every branch gets it."""
        for c in self.caches:
            c.copy_from(main, self.m, p)

    def adopt(self, j: int, main: KVCache, p: int) -> None:
        """Branch ``j`` was confirmed: its entry at ``p`` becomes main's and the others'."""
        win = self.caches[j]
        for c in (main, *(c for c in self.caches if c is not win)):
            c.copy_from(win, self.m, p)

    # ----- one fork -----------------------------------------------------------------------------
    def fork(self, cands: torch.Tensor, p: int) -> None:
        """Start candidate ``cands[j]`` at position ``p`` on branch ``j`` (may return before
        they finish)."""
        raise NotImplementedError

    def predict(self, hm: torch.Tensor, p: int) -> None:
        """Make the early prediction from ``hm`` (the main token after layer ``d_bar``) on the
        branches' side and fork its candidates at ``p``."""
        raise NotImplementedError

    def join(self) -> tuple[list[int], list[torch.Tensor]]:
        """Wait for the last fork: its candidates and each branch's hidden state."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what the branches run on."""
        for c in self.caches:
            self.runner.release(c)


class SerialBranches(Branches):
    """Branches run at :meth:`fork`, one after another, on the calling thread."""

    def fork(self, cands: torch.Tensor, p: int) -> None:
        self._cands = cands
        self._states = [branch(self.runner, c, cands[j : j + 1], p, self.m)
                        for j, c in enumerate(self.caches[: cands.shape[0]])]

    def join(self) -> tuple[list[int], list[torch.Tensor]]:
        return self._cands.tolist(), self._states


class StreamBranches(SerialBranches):
    """Each branch launched on its own CUDA stream after the main stream's writes; joined by
    making the main stream wait for them (no host thread, no GIL hand-off)."""

    def __init__(self, runner: Runner, m: int, k: int, head: tuple[int, int]) -> None:
        super().__init__(runner, m, k, head)
        self.streams = [torch.cuda.Stream(device=runner.device) for _ in range(k)]

    def fork(self, cands: torch.Tensor, p: int) -> None:
        current = torch.cuda.current_stream(self.runner.device)
        self._cands = cands
        self._states = []
        for j, c in enumerate(self.caches[: cands.shape[0]]):
            stream = self.streams[j]
            stream.wait_stream(current)  # the prefix entries main wrote
            with torch.cuda.stream(stream):
                self._states.append(branch(self.runner, c, cands[j : j + 1], p, self.m))

    def join(self) -> tuple[list[int], list[torch.Tensor]]:
        current = torch.cuda.current_stream(self.runner.device)
        for stream in self.streams:
            current.wait_stream(stream)
        return super().join()


class ThreadBranches(Branches):
    """Branches on pool threads; the early prediction too (one more thread)."""

    predicts = True

    def __init__(self, runner: Runner, m: int, k: int, head: tuple[int, int], *,
                 predicts: bool) -> None:
        super().__init__(runner, m, k, head)
        self.predicts = predicts
        self.pool = ThreadPoolExecutor(max_workers=k + int(predicts))
        self._job: Future[Any] | None = None

    def fork(self, cands: torch.Tensor, p: int) -> None:
        jobs = self._start(cands, p)
        self._job = None
        self._jobs = (cands, jobs)

    def _start(self, cands: torch.Tensor, p: int) -> list[Future[torch.Tensor]]:
        return [self.pool.submit(self._branch, c, cands[j : j + 1], p)
                for j, c in enumerate(self.caches[: cands.shape[0]])]

    def _branch(self, cache: KVCache, token: torch.Tensor, p: int) -> torch.Tensor:
        with torch.inference_mode():
            return branch(self.runner, cache, token, p, self.m)

    def predict(self, hm: torch.Tensor, p: int) -> None:
        self._job = self.pool.submit(self._predict, hm.clone(), p)

    def _predict(self, hm: torch.Tensor, p: int) -> tuple[list[int], list[torch.Tensor]]:
        with torch.inference_mode():
            logits = self.runner.logits(hm, self.d_bar, vocab=self.vocab)[0, -1]
            cands = self.runner.draft_tokens(torch.topk(logits, self.k).indices, self.vocab)
            return cands.tolist(), [j.result() for j in self._start(cands, p)]

    def join(self) -> tuple[list[int], list[torch.Tensor]]:
        if self._job is not None:
            job, self._job = self._job, None
            return job.result()
        cands, jobs = self._jobs
        return cands.tolist(), [j.result() for j in jobs]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        super().close()
