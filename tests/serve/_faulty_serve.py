"""``exitlm serve`` with one more strategy, ``faulty``: plain autoregressive decoding whose
decoding steps raise while a sequence whose prompt contains the bytes ``FAIL`` is running
(the first token, from the prefill, still comes out). The server tests use it to check that an
engine failure is a 500 and that the server goes on.

    python _faulty_serve.py serve CHECKPOINT --strategy faulty ...
"""

from __future__ import annotations

import sys

from exitlm.cli import main
from exitlm.infer.autoregressive import AROptions, DepthDecoder
from exitlm.infer.decoder import Batch, Emit
from exitlm.infer.strategies import Strategy, register_strategy

MARKER = list(b"FAIL")


def _marked(prompt: list[int]) -> bool:
    n = len(MARKER)
    return any(prompt[i:i + n] == MARKER for i in range(len(prompt) - n + 1))


class FaultyDecoder(DepthDecoder):
    def step(self, batch: Batch) -> list[Emit]:
        if any(_marked(s.prompt) for s in batch.seqs):
            raise RuntimeError("injected failure")
        return super().step(batch)


register_strategy(Strategy("faulty", AROptions, FaultyDecoder, "AR that fails on FAIL"))

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
