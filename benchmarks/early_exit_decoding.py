"""Early-exit decoding strategies vs autoregressive decoding and transformers (one JSON).

Runs ``exitlm bench`` (see :mod:`exitlm.bench.run`) with the settings of docs/measurements/:
our ``ar``, ``early-exit`` (KV recomputation), ``self-spec`` and ``ppd`` against
transformers' greedy ``generate`` (``hf``) and its LayerSkip integration
``assistant_early_exit`` (``hf-ee``) on the same weights, over built-in code-completion prompts
from held-out standard-library files, one thread, all ratios from the same run.

    python benchmarks/early_exit_decoding.py                      # default-ee (or default)
    python benchmarks/early_exit_decoding.py --layerskip-exits    # exits via final norm+head
    python benchmarks/early_exit_decoding.py --quick              # 2 prompts, 24 tokens
"""

from __future__ import annotations

import sys

from exitlm.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--quick" in argv:
        argv.remove("--quick")
        argv = ["--num-prompts", "2", "--max-new-tokens", "24", *argv]
    sys.exit(main(["bench", *argv]))
