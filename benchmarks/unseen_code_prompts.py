"""Code-completion prompts from installed packages a code model never saw (one JSONL file).

``exitlm bench``'s built-in prompts come from held-out files of the standard library, whose other
files ``layerskip-code`` was trained on; a lossy strategy's settings (early exit's threshold)
are better checked on code of other projects too. This writes ``--count`` prompts, each the six
lines before a ``def`` of a random ``*.py`` file of the named installed packages plus the
``def`` line and the next one (ASCII files over 3 KB, prompts of 80-600 characters), seeded, in
the JSONL form ``exitlm bench --prompts`` reads:

    python benchmarks/unseen_code_prompts.py --out /tmp/unseen.jsonl
    exitlm bench --model layerskip-code --strategies ar,early-exit --threshold 0.95 \\
        --prompts /tmp/unseen.jsonl --num-prompts 60 --max-new-tokens 128 --threads 1

Packages missing here are skipped; the file names the packages and files used on stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from importlib.util import find_spec
from pathlib import Path

from _bench import note, one_line_errors
from exitlm.args import int_at_least

PACKAGES = ("numpy", "pip", "setuptools", "yaml", "jinja2", "click", "requests", "urllib3",
            "rich", "pygments")
"""Not the standard library, torch or transformers (``layerskip-code``'s training data)."""


def package_files(names: list[str]) -> list[Path]:
    """The ``*.py`` files over 3 KB of the installed packages among ``names``."""
    files: list[Path] = []
    for name in names:
        spec = find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            note(f"{name}: not installed (skipped)")
            continue
        for root in spec.submodule_search_locations:
            files += sorted(p for p in Path(root).rglob("*.py") if p.stat().st_size > 3000)
    return files


def prompts_from(files: list[Path], count: int, seed: int) -> list[str]:
    """Up to ``count`` prompts, one per file, files in a seeded random order."""
    rng = random.Random(seed)
    files = list(files)
    rng.shuffle(files)
    out: list[str] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="ignore")
        if not text.isascii():
            continue
        lines = text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and i > 5]
        if not starts:
            continue
        i = rng.choice(starts)
        prompt = "".join(lines[i - 6: i + 2])
        if 80 < len(prompt) < 600:
            out.append(prompt)
        if len(out) >= count:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument("--count", type=int_at_least(1), default=60)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--packages", default=",".join(PACKAGES),
                    help="comma-separated installed packages to draw from")
    args = ap.parse_args(argv)
    files = package_files([p for p in args.packages.split(",") if p])
    prompts = prompts_from(files, args.count, args.seed)
    if not prompts:
        ap.error(f"--packages {args.packages}: no usable *.py files installed")
    out = Path(args.out)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    note(f"wrote {len(prompts)} prompts from {len(files)} files to {out}")
    return 0


if __name__ == "__main__":
    with one_line_errors("unseen_code_prompts"):
        sys.exit(main())
