"""``exitlm serve`` with one more strategy, ``faulty``: plain autoregressive decoding whose
decoding steps raise while a sequence whose prompt contains the bytes ``FAIL`` is running
(the first token, from the prefill, still comes out), and whose steps take at least 5 ms while
a sequence whose prompt contains ``SLOW`` runs (so a long request outlasts a client's timeout
however fast the machine decodes). The server tests use it to check that an engine failure is
a 500 and that the server goes on, and how disconnects and shutdown treat long requests.

    python _faulty_serve.py serve CHECKPOINT --strategy faulty ...
"""

from __future__ import annotations

import sys
import time

from exitlm.cli import main
from exitlm.infer.autoregressive import AROptions, DepthDecoder
from exitlm.infer.decoder import Batch, Emit
from exitlm.infer.strategies import Strategy, register_strategy

FAIL, SLOW = list(b"FAIL"), list(b"SLOW")
STEP_S = 0.005


def _marked(prompt: list[int], marker: list[int]) -> bool:
    n = len(marker)
    return any(prompt[i:i + n] == marker for i in range(len(prompt) - n + 1))


class FaultyDecoder(DepthDecoder):
    def step(self, batch: Batch) -> list[Emit]:
        if any(_marked(s.prompt, FAIL) for s in batch.seqs):
            raise RuntimeError("injected failure")
        if any(_marked(s.prompt, SLOW) for s in batch.seqs):
            time.sleep(STEP_S)
        return super().step(batch)


register_strategy(Strategy("faulty", AROptions, FaultyDecoder, "AR that fails on FAIL"))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
