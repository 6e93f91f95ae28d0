"""Train, evaluate and export ``layerskip-code`` in one call of a lent GPU machine; ship it here.

``train`` runs on the device machine (it has PyTorch and the Python sources of many large
packages, but no package index): it builds the corpus from the Python sources installed there,
measures how long a training step takes, picks ``train.steps`` so that training ends inside
``--budget-s`` (with time left for evaluation and export), trains in chunks, and after every
chunk writes the model (fp16, shards under the device tool's 16 MiB file limit) and a report to
``--out``: a run stopped by its time limit still hands back its latest weights. The report holds
the held-out perplexity and top-1 agreement with the final layer of every exit, and for each
exit layer ``E`` and draft length ``d`` the self-speculation rounds that the held-out text's
agreement implies (LayerSkip Sec. 4.3: drafts from layer ``E`` are accepted while they agree
with the full model).

``ship`` runs here: it checks the returned files against the report's hashes, installs them as
``exitlm/data/layerskip_code`` (with a byte-level tokenizer, whose end of text is byte 0, the
corpus' document separator) and writes the model card from the report.

    python device/layerskip_code.py train --out "$OUT" --budget-s 500      # device machine
    python device/layerskip_code.py ship /work/.device/.../out              # here

Run from the repository root with ``PYTHONPATH=src`` where exitlm is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import shutil
import site
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from exitlm.args import draft_round, finite_float, int_at_least, unit_float  # (torch-free)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "layerskip-code.yaml"
MODEL_DIR = "layerskip_code"
REPORT = "report.json"
SHARD_BYTES = 15 * 2**20  # the device tool returns files of at most 16 MiB
# large, well-written Python code bases first; then every other installed package by name
PREFERRED = (
    "torch", "transformers", "jax", "flax", "scipy", "sklearn", "pandas", "sympy", "numpy",
    "matplotlib", "networkx", "statsmodels", "skimage", "xarray", "torchvision", "optax",
    "lightning", "pytorch_lightning", "accelerate", "peft", "sentence_transformers", "onnx",
    "triton", "botorch", "gpytorch", "numpyro", "equinox", "hypothesis", "torch_geometric",
    "numba", "cupy", "timm", "setuptools", "pip", "pygments", "rich", "requests", "aiohttp",
    "jinja2", "seaborn", "tensorboard", "orbax", "chex",
)
EXIT_CANDIDATES = (3, 4, 5, 6, 7, 8, 10, 12, 16)
DRAFTS = (1, 2, 3, 4, 5, 6, 7, 8)


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + " (CPU)"
    except OSError:
        pass
    return (platform.processor() or "unknown") + " (CPU)"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----- corpus ----------------------------------------------------------------------------------

def py_bytes(root: Path | None = None) -> int:
    """The ``*.py`` bytes the corpus reads under ``root`` (``None``: the standard library,
    without the packages installed inside its folder)."""
    from exitlm.config import ConfigError
    from exitlm.io.corpus import DataConfig, list_sources

    cfg = DataConfig() if root is None else DataConfig(paths=(str(root),), suffixes=(".py",))
    try:
        return sum(p.stat().st_size for _, p in list_sources(cfg))
    except ConfigError:  # no *.py there
        return 0


def package_roots(max_bytes: int) -> tuple[list[Path], dict[str, int]]:
    """The installed package folders to train on, preferred ones first, until ``max_bytes`` of
    ``*.py`` (the standard library's counted first). Returns the folders and their sizes."""
    dirs: list[Path] = []
    for sp in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]:
        p = Path(sp)
        if p.is_dir() and p not in dirs:
            dirs.append(p)
    found: dict[str, Path] = {}
    for sp in dirs:
        for entry in sorted(sp.iterdir()):
            if entry.is_dir() and entry.name.isidentifier() and entry.name not in found:
                found[entry.name] = entry
    order = [n for n in PREFERRED if n in found]
    order += sorted(n for n in found if n not in PREFERRED)
    sizes = {"<stdlib>": py_bytes()}
    total = sizes["<stdlib>"]
    roots: list[Path] = []
    for name in order:
        if total >= max_bytes:
            break
        n = py_bytes(found[name])
        if n == 0 or total + n > max_bytes * 1.1:
            continue
        roots.append(found[name])
        sizes[name] = n
        total += n
    return roots, sizes


# ----- evaluation ------------------------------------------------------------------------------

def simulate_rounds(agree: list[bool], d: int) -> tuple[int, int, int]:
    """Self-speculation over one sequence whose positions' early-exit top-1 agrees with the
    final layer's where ``agree`` is true: each round drafts ``d`` tokens from layer ``E``,
    keeps the drafts up to the first disagreement and adds the verified token (LayerSkip
    Sec. 4.3). Returns (rounds, tokens emitted, drafts accepted)."""
    i = rounds = tokens = accepted = 0
    n = len(agree)
    while i < n:
        k = 0
        while k < d and i + k < n and agree[i + k]:
            k += 1
        rounds += 1
        accepted += k
        tokens += k + 1
        i += k + 1
    return rounds, tokens, accepted


def acceptance_table(model: Any, batches: list[Any], layers: tuple[int, ...]) -> dict[str, Any]:
    """For every exit layer and draft length: tokens per round and the share of drafts
    accepted, from the held-out windows' per-position agreement of layer ``E`` with the final
    layer; plus the round cost model ``(d*E + L) / L`` full-model steps per round, whose ratio
    to the tokens per round is what self-speculation would gain if a verification of ``d + 1``
    positions cost one step (it costs more: measure on the target CPU)."""
    import torch

    from exitlm.infer.per_exit import exit_logits_any
    from exitlm.model.transformer import default_positions

    L = model.num_layers
    want = sorted({x for x in layers if 1 <= x < L} | {L})
    device = model.embed_tokens.weight.device
    agree: dict[int, list[list[bool]]] = {k: [] for k in want if k != L}
    with torch.no_grad():
        for tokens, _labels in batches:
            tokens = tokens.to(device)
            pos = default_positions(tokens)
            ctx = model.context(pos)
            top1 = {}
            for k, h in model.walk(model.embed(tokens, pos), 0, L, want, ctx=ctx):
                top1[k] = exit_logits_any(model, h, k, ctx)[0].argmax(-1).cpu()
            for k in agree:
                agree[k].extend((top1[k] == top1[L]).tolist())
    table: dict[str, Any] = {}
    for k, rows in agree.items():
        for d in DRAFTS:
            r = t = a = 0
            for row in rows:
                r1, t1, a1 = simulate_rounds(row, d)
                r, t, a = r + r1, t + t1, a + a1
            cost = (d * k + L) / L
            table[f"E{k}_d{d}"] = {"exit": k, "drafts": d, "tokens_per_round": t / r,
                                  "acceptance": a / (r * d), "ideal_speedup": t / r / cost}
    return table


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----- train (device machine) -------------------------------------------------------------------

def train(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from exitlm.io.corpus import stdlib_root
    from exitlm.io.native import save_native
    from exitlm.paths import write_text_atomic
    from exitlm.train.config import load_config
    from exitlm.train.data import eval_batches, prepare
    from exitlm.train.trainer import Trainer

    report: dict[str, Any] = {"format": 1, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                              "budget_s": args.budget_s, "argv": sys.argv[1:]}
    cuda = torch.cuda.is_available()
    report["machine"] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else cpu_name(),
        "cpus": os.cpu_count(),
    }
    log(f"machine: {report['machine']}")

    def write_report() -> None:
        write_text_atomic(out / REPORT, json.dumps(report, indent=1) + "\n")

    # corpus: the standard library + installed packages' *.py, capped
    stdlib = stdlib_root()
    if args.roots:
        roots = [Path(r) for r in args.roots]
        sizes = {"<stdlib>": py_bytes(), **{r.name: py_bytes(r) for r in roots}}
    else:
        roots, sizes = package_roots(int(args.max_corpus_mb * 1e6))
    paths = [str(stdlib), *map(str, roots)]
    overrides = [f"data.paths={json.dumps(paths)}", "train.progress=false",
                 "train.tensorboard=false", *args.set]
    if not cuda:
        overrides.append("optim.fused=false")  # (fused AdamW is tested on CUDA only)
    cfg = load_config(str(args.config), overrides)
    # the trainer's own files stay outside --out: only the model and the report come back
    # (each trainer gets a folder in here through with_steps)
    work = Path(tempfile.mkdtemp(prefix="layerskip-code-"))
    log(f"corpus: {len(paths)} roots, *.py {sum(sizes.values()) / 1e6:.0f} MB "
        f"(capped at {args.max_corpus_mb} MB)")
    t0 = time.monotonic()
    data_dir = prepare(cfg.data, progress=False)
    meta = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    meta.pop("val_documents", None)
    report["corpus"] = {"roots": paths, "py_bytes": sizes, "prepare_s": time.monotonic() - t0,
                        "meta": meta}
    log(f"data: {meta['tokens']['train']} train / {meta['tokens']['val']} held-out tokens "
        f"in {time.monotonic() - t0:.0f} s")
    write_report()

    # calibration: how long one step takes here
    def with_steps(steps: int, out_dir: Path) -> Any:
        return dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, steps=steps, out_dir=str(out_dir)))

    def calibrate() -> float:
        cal = Trainer(with_steps(1000, work / "calibration"), overwrite=True)
        times = []
        for i in range(args.calibrate_steps):
            s0 = time.perf_counter()
            cal.train_step()
            if cuda:
                torch.cuda.synchronize()
            if i >= min(3, args.calibrate_steps - 1):
                times.append(time.perf_counter() - s0)
        del cal
        if cuda:
            torch.cuda.empty_cache()
        shutil.rmtree(work / "calibration", ignore_errors=True)
        return statistics.median(times)

    t0 = time.monotonic()
    try:
        step_s = calibrate()
    except Exception as err:  # the calibration is also the run's smoke test
        if not cfg.optim.fused:
            raise
        log(f"fused AdamW failed here ({type(err).__name__}: {err}); using the loop")
        report["fused_adamw_error"] = f"{type(err).__name__}: {err}"
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, fused=False))
        step_s = calibrate()
    left = deadline - time.monotonic() - args.reserve_s
    steps = max(args.min_steps, min(args.max_steps, int(left / step_s * 0.93)))
    report["calibration"] = {"steps": args.calibrate_steps, "step_s": step_s,
                             "took_s": time.monotonic() - t0, "train_steps": steps}
    log(f"calibration: {step_s * 1e3:.0f} ms a step -> {steps} steps in {left:.0f} s")
    write_report()

    # training, in chunks; the model and report go to --out after every chunk
    run_cfg = with_steps(steps, work / "run")
    trainer = Trainer(run_cfg, overwrite=True)
    report["config"] = run_cfg.to_dict()
    mcfg = trainer.layout.host_model().config
    report["model"] = {"layers": mcfg.num_layers, "dim": mcfg.dim,
                       "parameters": sum(p.numel() for p in trainer.layout.host_model()
                                         .parameters()),
                       "precision": "bf16 autocast" if trainer.amp_dtype is not None else "fp32"}
    report["train"] = {"steps_planned": steps, "log": []}
    chunk = max(1, int(args.export_every_s / step_s))
    t_train = time.monotonic()

    def export() -> Path:
        host = trainer.layout.host_model()
        target = save_native(host, out / MODEL_DIR, overwrite=True, dtype=torch.float16,
                             max_shard_bytes=args.shard_bytes)
        report["files"] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                           for p in sorted(target.iterdir())}
        report["train"]["steps_done"] = trainer.step
        report["train"]["train_s"] = time.monotonic() - t_train
        write_report()
        return target

    stopped_early = False
    while trainer.step < steps:
        # a chunk ends at the next export or where the time left for training runs out
        fits = int((deadline - args.reserve_s - time.monotonic()) / step_s)
        records = trainer.train(until_step=min(steps, trainer.step + max(1, min(chunk, fits))))
        for r in records[:: max(1, len(records) // 4)] + records[-1:]:
            report["train"]["log"].append({k: r[k] for k in ("step", "loss", "lr", "tokens_per_s")
                                           if k in r})
        last = records[-1]
        log(f"step {trainer.step}/{steps} loss {last['loss']:.4f} "
            f"{last.get('tokens_per_s', 0) / 1e3:.0f}k tok/s, "
            f"{deadline - time.monotonic():.0f} s left")
        export()
        if trainer.step < steps and time.monotonic() > deadline - args.reserve_s:
            stopped_early = True
            log("out of time: stopping early (the learning rate did not finish its decay)")
            break
    report["train"]["stopped_early"] = stopped_early
    with (work / "run" / "log.jsonl").open(encoding="utf-8") as f:
        report["train"]["evals"] = [r for r in map(json.loads, f) if r.get("split") == "val"]
    target = out / MODEL_DIR  # (exported after the last chunk)

    # evaluation of the shipped weights (rounded to fp16; buffers such as the rotary
    # frequencies are not saved, the loader recomputes them in fp32), on held-out windows
    t0 = time.monotonic()
    model = trainer.layout.host_model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    val = trainer.val_data
    batches = list(eval_batches(val, 32, args.eval_samples))
    from exitlm.infer.per_exit import evaluate_exits

    layers = list(range(1, model.num_layers + 1))
    metrics = evaluate_exits(model, batches, layers)
    report["exits"] = [m.to_dict() for m in metrics]
    write_report()
    report["self_spec"] = acceptance_table(model, batches[: max(1, len(batches) // 4)],
                                           EXIT_CANDIDATES)
    report["eval_s"] = time.monotonic() - t0
    report["total_s"] = time.monotonic() - t_start
    write_report()
    shutil.rmtree(work, ignore_errors=True)  # the trainer's logs: in the report
    best = max(report["self_spec"].values(), key=lambda r: r["ideal_speedup"])
    log("per-exit held-out ppl: " + ", ".join(
        f"{m.layer}:{m.ppl:.2f}" for m in metrics if m.layer in (1, 4, 6, 8, 12, 16, 24)))
    log(f"best E={best['exit']} d={best['drafts']}: {best['tokens_per_round']:.2f} tokens a "
        f"round, acceptance {best['acceptance']:.0%}")
    log(f"done in {report['total_s']:.0f} s: {target}")
    return 0


# ----- ship (here) ---------------------------------------------------------------------------

def ship(args: argparse.Namespace) -> int:
    from exitlm.infer.cli import byte_level_tokenizer
    from exitlm.io import load_model
    from exitlm.io.native import weight_files
    from exitlm.io.st import atomic_dir

    src = Path(args.src)
    if not (src / REPORT).is_file():
        sys.exit(f"layerskip_code.py ship: {src / REPORT} is missing (pass the folder the "
                 "device call returned)")
    report = json.loads((src / REPORT).read_text(encoding="utf-8"))
    notes = ""
    if args.notes is not None:
        try:
            notes = Path(args.notes).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"layerskip_code.py ship: --notes {args.notes}: cannot read it ({e})")
    model_src = src / MODEL_DIR
    for name, info in report.get("files", {}).items():
        got = sha256(model_src / name)
        if got != info["sha256"]:
            sys.exit(f"{model_src / name}: sha256 {got} differs from the report's "
                     f"{info['sha256']} (a partial copy?)")
    weight_files(model_src)  # every shard present
    report["stdlib_agreement"] = stdlib_agreement(load_model(str(model_src)).model)
    report["shipped_with_python"] = platform.python_version()
    report["stages"] = [*earlier_stages(report), stage_of(report)]
    target = Path(args.to)
    with atomic_dir(target, overwrite=args.overwrite) as tmp:
        for p in sorted(model_src.iterdir()):
            shutil.copy2(p, tmp / p.name)
        if args.draft is not None:
            set_draft(tmp, *args.draft)
            report["draft"] = dict(zip(("exit_layer", "num_speculations", "weights"),
                                       args.draft, strict=True))
        if args.threshold is not None:
            set_threshold(tmp, args.threshold)
            report["threshold"] = args.threshold
        tok = byte_level_tokenizer()
        tok.eos_token_ids = (0,)
        tok.save(tmp)
        (tmp / "training.json").write_text(json.dumps(
            {k: report[k] for k in ("argv", "machine", "model", "corpus", "calibration", "config",
                                    "train", "exits", "stdlib_agreement", "shipped_with_python",
                                    "self_spec", "draft", "threshold", "total_s", "stages")
             if k in report}, indent=1) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(report, notes), encoding="utf-8")
    loaded = load_model(str(target))
    print(f"shipped {target} ({sum(p.stat().st_size for p in target.iterdir()) / 1e6:.1f} MB, "
          f"{sum(p.numel() for p in loaded.model.parameters()) / 1e6:.1f}M parameters)")
    return 0


def set_draft(folder: Path, exit_layer: int, drafts: int, weights: str = "model") -> None:
    """Record the measured best self-speculative round as ``exits.draft`` of the config in
    ``folder`` (checked against the model's exits before anything is written)."""
    from exitlm.io.native import native_config, write_native_config

    write_native_config(folder, native_config(folder).with_draft(exit_layer, drafts, weights))


def set_threshold(folder: Path, threshold: float) -> None:
    """Record the early-exit threshold measured to keep plain decoding's output as
    ``exits.threshold`` of the config in ``folder``."""
    from exitlm.io.native import native_config, write_native_config

    write_native_config(folder, native_config(folder).with_threshold(threshold))


STAGE_KEYS = ("argv", "machine", "model", "corpus", "calibration", "config", "train")
"""What a report says of one training run: a stage of the shipped model's training."""


def stage_of(report: dict[str, Any]) -> dict[str, Any]:
    """The :data:`STAGE_KEYS` of a run's report (or of a shipped ``training.json``)."""
    return {k: report[k] for k in STAGE_KEYS if k in report}


def earlier_stages(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The training stages before this run: where the run started from a shipped model
    (``--set model.init=<its folder>``), that model's own stages as its ``training.json``
    records them (one stage where it records none), less this run's own (shipping a run
    again, over the folder it shipped to before); else none."""
    init = str(report.get("config", {}).get("model", {}).get("init", ""))
    if not init:
        return []
    for base in (Path.cwd(), REPO):
        card = base / init / "training.json"
        if card.is_file():
            prev = json.loads(card.read_text(encoding="utf-8"))
            return [s for s in prev.get("stages") or [stage_of(prev)] if s != stage_of(report)]
    return []


AGREEMENT_FILES, AGREEMENT_BYTES = 16, 1025


def stdlib_agreement(model: Any) -> dict[str, float]:
    """How often each layer's exit (through the shared final norm and head) picks the final
    layer's token on this machine's held-out standard-library files (the first
    :data:`AGREEMENT_FILES` held-out files of over :data:`AGREEMENT_BYTES` bytes, teacher
    forced): the rates the model card documents, checked by the tests on a few of them."""
    import torch

    from exitlm.infer.per_exit import evaluate_exits
    from exitlm.io.corpus import DataConfig, held_out_samples

    windows = held_out_samples(DataConfig(), AGREEMENT_FILES, AGREEMENT_BYTES)
    tokens = torch.tensor([list(w) for w in windows])
    metrics = evaluate_exits(model, [(tokens[:, :-1], tokens[:, 1:])],
                             range(1, model.num_layers + 1))
    return {str(m.layer): m.agree_top1 for m in metrics}


def _stage_data(stage: dict[str, Any]) -> str:
    """What one training stage read: its corpus and its size."""
    corpus = stage.get("corpus", {})
    sizes = corpus.get("py_bytes", {})
    meta = corpus.get("meta", {})
    packages = [k for k in sizes if k != "<stdlib>"]
    python = stage.get("machine", {}).get("python", "?")
    what = (f"the `*.py` files of the Python {python} standard library and of {len(packages)} "
            f"installed packages of the training machine ({sum(sizes.values()) / 1e6:.0f} MB): "
            + ", ".join(packages) if packages else
            f"the `*.py` files of the Python {python} standard library alone "
            f"({sum(sizes.values()) / 1e6:.0f} MB)")
    return (f"{what}; {meta.get('tokens', {}).get('train', '?')} training bytes, "
            f"{meta.get('tokens', {}).get('val', '?')} held out")


def _stage_recipe(stage: dict[str, Any]) -> list[str]:
    """How one training stage ran, and its exact command."""
    m = stage.get("machine", {})
    tr = stage.get("train", {})
    cal = stage.get("calibration", {})
    cfg = stage.get("config", {})
    on_cpu = str(m.get("device", "")).endswith("(CPU)")  # (cpu_name's mark)
    precision = stage.get("model", {}).get("precision", "?")
    distill = float(cfg.get("loss", {}).get("distill") or 0)
    objective = (f"exits distilled from the final layer (`loss.distill={distill}`: each exit's "
                 f"loss {1 - distill:g} x cross-entropy + {distill:g} x KL to the final "
                 "output), " if distill > 0 else "")
    text = (f"`configs/layerskip-code.yaml`: {tr.get('steps_done', '?')} steps of "
            f"{cfg.get('train', {}).get('batch_size', '?')} x "
            f"{cfg.get('data', {}).get('seq_len', '?')} bytes, AdamW lr "
            f"{cfg.get('optim', {}).get('lr', '?')} (warm-up "
            f"{cfg.get('optim', {}).get('warmup_steps', '?')}, cosine), "
            + objective + f"{precision}, on "
            + (f"{m.get('cpus', '?')} cores of an {m.get('device', '?')}" if on_cpu
               else f"one {m.get('device', '?')}")
            + f" ({cal.get('step_s', 0) * 1e3:.0f} ms a step, "
            f"{tr.get('train_s', 0) / 60:.1f} min of training"
            + (", stopped early by its time limit" if tr.get("stopped_early") else "") + ").")
    argv = stage.get("argv")
    if not argv:
        return [text, ""]
    return [text + (" The exact command:" if on_cpu
                    else " The exact command, run in one call of the GPU machine:"), "",
            "```bash",
            "PYTHONPATH=src python device/layerskip_code.py train --out \"$OUT\" "
            + " ".join(shlex.quote(a) for a in _without_out(argv[1:])),
            "```", ""]


def model_card(report: dict[str, Any], notes: str = "") -> str:
    """The model card (README.md beside the weights) from the training report: its training
    stages (``report["stages"]``, oldest first; the report itself when it lists none) and the
    developer's ``notes`` (markdown: what was measured after training) at the end."""
    mod = report.get("model", {})
    stages = report.get("stages") or [stage_of(report)]
    one = len(stages) == 1
    lines = [
        "# layerskip-code",
        "",
        f"A {mod.get('layers', '?')}-layer byte-level model of Python code (dim "
        f"{mod.get('dim', '?')}, {mod.get('parameters', 0) / 1e6:.1f}M parameters) trained "
        "with the "
        "LayerSkip recipe: layer dropout rising with depth and time (p_max 0.1, S_exp; "
        "LayerSkip Eq. 1-4) and the early-exit loss at every layer through the shared final "
        "norm and LM head (Eq. 5, e_scale 1, no curriculum). Every layer can exit; "
        "self-speculative decoding drafts from an early layer and verifies with the rest "
        "(Sec. 4.3). Stored in fp16 (exitlm's format, shards of at most 15 MiB); the "
        "tokenizer is one token per UTF-8 byte, byte 0 ends a document.",
        "",
        "## Data",
        "",
    ]
    if one:
        data = _stage_data(stages[0])
        lines.append(data[0].upper() + data[1:] + ".")
    else:
        lines += [f"{i + 1}. Stage {i + 1}" + (" (from the weights of stage "
                                                 f"{i})" if i else "") + ": "
                  + _stage_data(st) + "." for i, st in enumerate(stages)]
        lines.append("")
    lines += [
        "The held-out files are chosen by a hash of their path inside their folder "
        "(exitlm.io.corpus.is_held_out, 2%), the same split `exitlm bench` draws its prompts "
        "from, so the benchmark prompts were never trained on. Licences: the Python standard "
        "library is under the PSF License; the packages are under their own open-source "
        "licences (BSD, MIT, Apache-2.0 and similar, as each package's metadata states); the "
        "weights are a statistical model of that code and are released under Apache-2.0 "
        "like exitlm.",
        "",
        "## Recipe",
        "",
    ]
    for i, st in enumerate(stages):
        recipe = _stage_recipe(st)
        if not one:
            recipe[0] = f"**Stage {i + 1}**" + (f" (from stage {i}'s weights)" if i else "") \
                + ": " + recipe[0]
        lines += recipe
    lines += ["Then, where the files came back: "
              "`python device/layerskip_code.py ship OUT_FROM_THE_DEVICE`.", "",
              "## Held-out perplexity per exit (bytes, fp16 weights)", ""]
    exits = report.get("exits", [])
    if exits:
        lines += ["| layer | " + " | ".join(str(e["layer"]) for e in exits) + " |",
                  "|---|" + "---|" * len(exits),
                  "| perplexity | " + " | ".join(f"{e['ppl']:.2f}" for e in exits) + " |",
                  "| top-1 = final | " + " | ".join(f"{e['agree_top1']:.0%}" for e in exits)
                  + " |"]
        here = report.get("stdlib_agreement", {})
        if here:
            lines.append("| top-1 = final, held-out stdlib | " + " | ".join(
                f"{here.get(str(e['layer']), float('nan')):.0%}" for e in exits) + " |")
        lines += ["", "Perplexity and the first agreement row: held-out windows of the training "
                  "corpus; the last row: teacher forced over the first "
                  f"{AGREEMENT_FILES} held-out files of the Python "
                  f"{report.get('shipped_with_python', '?')} standard library "
                  f"({AGREEMENT_BYTES - 1} bytes each), which "
                  "`tests/io/test_shipped_layerskip_code.py` checks.", ""]
    spec = report.get("self_spec", {})
    if spec:
        best = sorted(spec.values(), key=lambda r: -r["ideal_speedup"])[:5]
        lines += ["## Self-speculation on held-out text",
                  "",
                  "Drafts from layer E accepted while they agree with the final layer, "
                  "simulated on held-out windows (teacher-forced agreement): what the exits "
                  "allow, not a speed (that depends on the CPU and the verification's cost).",
                  "",
                  "| E | d | tokens a round | drafts accepted |",
                  "|---|---|---|---|"]
        lines += [f"| {r['exit']} | {r['drafts']} | {r['tokens_per_round']:.2f} | "
                  f"{r['acceptance']:.0%} |" for r in best]
        lines.append("")
    draft = report.get("draft")
    if draft:
        weights = draft.get("weights", "model")
        copy = ("" if weights == "model" else
                f", drafting through an {weights} copy of the model (`--draft-weights "
                f"{weights}`: a quantized copy of the weights for the drafts, the model's own "
                "for verification; where the copy cannot run, the model drafts)")
        lines += [f"The config records E={draft['exit_layer']}, d={draft['num_speculations']}"
                  f"{copy} as the round measured fastest in timed decoding (`exits.draft`): "
                  "`--strategy self-spec` drafts there unless another round promises clearly "
                  "more on the text at hand, or plain steps do.", ""]
    threshold = report.get("threshold")
    if threshold is not None:
        lines += [f"The config records `exits.threshold` {threshold:g}, the early-exit "
                  "confidence threshold measured to keep plain decoding's output on held-out "
                  "prompts: `--strategy early-exit` uses it when `--threshold` is not given.",
                  ""]
    if notes.strip():
        lines += [notes.strip(), ""]
    return "\n".join(lines)


def _without_out(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="build the corpus, train, evaluate, export (device)")
    t.add_argument("--out", required=True, help="where the model and report go ($OUT)")
    t.add_argument("--budget-s", type=positive_float, default=500.0,
                   help="wall-clock seconds for everything (default 500)")
    t.add_argument("--reserve-s", type=non_negative_float, default=60.0,
                   help="seconds kept for evaluation and export (default 60)")
    t.add_argument("--config", type=Path, default=CONFIG)
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (as `exitlm train`)")
    t.add_argument("--max-corpus-mb", type=positive_float, default=400.0)
    t.add_argument("--roots", nargs="*", help="train on these folders (besides the standard "
                   "library) instead of the installed packages")
    t.add_argument("--calibrate-steps", type=int_at_least(1), default=12)
    t.add_argument("--min-steps", type=int_at_least(1), default=1)
    t.add_argument("--max-steps", type=int_at_least(1), default=20000)
    t.add_argument("--export-every-s", type=positive_float, default=90.0)
    t.add_argument("--eval-samples", type=int_at_least(1), default=512)
    t.add_argument("--shard-bytes", type=int_at_least(1), default=SHARD_BYTES)
    s = sub.add_parser("ship", help="install the returned model as exitlm/data/layerskip_code")
    s.add_argument("src", help="the folder the device call returned ($OUT's copy)")
    s.add_argument("--to", default=str(REPO / "src" / "exitlm" / "data" / MODEL_DIR))
    s.add_argument("--overwrite", action="store_true")
    s.add_argument("--notes", metavar="FILE.md",
                   help="markdown appended to the model card (what was measured after "
                        "training: decoding speed, quality)")
    s.add_argument("--draft", metavar="E,D[,W]", type=draft_round,
                   help="the self-speculative round measured fastest on held-out text "
                        "(`exitlm bench --sweep speculation`; W: what the drafts ran on, "
                        "model, int8 or int4): recorded as the config's exits.draft, which "
                        "self-speculation prefers")
    s.add_argument("--threshold", metavar="T", type=unit_float,
                   help="the early-exit confidence threshold measured to keep plain decoding's "
                        "output on held-out text (`exitlm bench --sweep threshold`): recorded "
                        "as the config's exits.threshold, early exit's default for the model")
    args = p.parse_args(argv)
    from exitlm.errors import ExitlmError

    try:
        return train(args) if args.cmd == "train" else ship(args)
    except ExitlmError as err:  # a bad setting, path or file: one line, as exitlm says it
        print(f"layerskip_code.py {args.cmd}: {err}", file=sys.stderr)
        return 2


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
