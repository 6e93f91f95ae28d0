"""``load_model``: the one entry point that turns a name or path into a ready model.

Accepted sources, tried in this order:

* ``"default"`` - the embedded SmolLM2-135M-Instruct (converted once into a local cache);
* a model shipped in the package (:mod:`exitlm.io.shipped`, e.g. ``"layerskip-code"`` when
  its weights are installed);
* an exit-head bundle: ``"default-ee"`` or a directory with ``exits.json`` (backbone + tuned
  exit heads, :mod:`exitlm.io.bundle`);
* a path to a ``.gguf`` file;
* a directory written by :func:`save_model` (``config.json`` carries ``exitlm_format_version``);
* a Megatron-LM / EE-LLM checkpoint directory (``latest_checkpointed_iteration.txt``,
  ``iter_*/mp_rank_*/model_optim_rng.pt``; :mod:`exitlm.io.megatron`), any TP x PP split;
* a Hugging Face directory (``config.json`` + ``*.safetensors``, sharded or not);
* a preset name from :data:`exitlm.config.PRESETS` (random initialisation, no tokenizer).

``dtype`` is a torch floating dtype or a weight-only quantization, ``"int8"`` / ``"int4"``
(:mod:`exitlm.kernels.quantized`): GGUF tensors stored as Q8_0/Q4_0/Q4_1 blocks (the embedded
model's, among them) are kept as they are, and every other linear weight is quantized to the
requested kind. A checkpoint saved quantized (``exitlm convert --quantize``) loads quantized.
"""

from __future__ import annotations

import difflib
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from exitlm.config import PRESETS, ConfigError, ExitConfig, preset
from exitlm.io.bundle import NAMED_BUNDLES, attach_heads, find_bundle, read_bundle
from exitlm.io.default_model import (
    DEFAULT_NAME,
    cache_dir_for,
    default_gguf_path,
    progress_note,
)
from exitlm.io.delta import apply_delta, base_of, is_delta_dir, read_delta_meta
from exitlm.io.gguf_load import (
    gguf_config,
    gguf_hf_tensors,
    gguf_name,
    gguf_tokenizer,
    open_gguf,
)
from exitlm.io.header_check import check_config_against_tensors
from exitlm.io.hf_dir import load_hf_dir
from exitlm.io.hf_map import CheckpointError, hf_names, hf_to_exitlm
from exitlm.io.loaded import (
    LoadedModel,
    cast_parameters,
    fill_special,
    keep_matching_exits,
    rebuild,
)
from exitlm.io.materialize import model_from_tensors
from exitlm.io.megatron import load_megatron
from exitlm.io.megatron_layout import is_megatron_dir
from exitlm.io.native import (
    is_native_dir,
    load_tokenizer_dir,
    native_config,
    native_tensors,
    save_native,
    weight_files,
)
from exitlm.io.shipped import shipped_dir, shipped_names
from exitlm.io.st import PICKLE_SUFFIXES, refuse_pickle, tensor_shapes
from exitlm.kernels.quantized import check_kind, quantize_heads, quantize_model
from exitlm.model.transformer import EarlyExitLM

DTYPE_NAMES: dict[str, torch.dtype | str] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "int8": "int8", "int4": "int4"}
"""What :func:`load_model` accepts as ``dtype`` by name: float formats -> torch dtypes, the
weight-only quantized formats (:mod:`exitlm.kernels.quantized`) -> their names."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """A float torch dtype or a quantized format's name (``"int8"`` / ``"int4"``) from a
    dtype or a name in :data:`DTYPE_NAMES`; anything else is a :class:`ConfigError` naming the
    value and the choices (an integer torch dtype cannot hold trained weights)."""
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ConfigError(f"dtype {dtype!r}: expected a float dtype or one of "
                      f"{', '.join(DTYPE_NAMES)}")


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    exits: ExitConfig | None = None,
    head_dtype: str | None = None,
) -> LoadedModel:
    """Load a model by name or path (see the module docstring for what is accepted).

    Args:
        dtype: parameter dtype (rotary frequencies stay fp32) or its name (``"float32"``,
            ``"fp16"``, ``"bf16"``, ...: :func:`parse_dtype`), or ``"int8"`` / ``"int4"`` for
            weight-only quantized linear layers and embedding (fp32 elsewhere).
        device: where the parameters end up.
        exits: replaces the checkpoint's exit configuration; heads the checkpoint lacks are
            freshly initialised, heads it has for layers/structures not requested are dropped.
        head_dtype: ``"int8"`` (or ``"int4"``) quantizes only the output embeddings of a float
            model (:func:`~exitlm.kernels.quantized.quantize_heads`: the LM head, the exits'
            own matrices, an output copy of a tied embedding); ``None``: as ``dtype``.
    """
    src = str(name_or_path)
    path = Path(src).expanduser()
    quant = None
    dtype = parse_dtype(dtype)
    if isinstance(dtype, str):
        quant, dtype = dtype, torch.float32
    if head_dtype is not None:
        check_kind(head_dtype)
        if quant is not None:
            raise ConfigError(f"head dtype {head_dtype!r} applies to float models; dtype "
                              f"{quant!r} quantizes the heads already (drop one of them)")
    bundle = find_bundle(src)  # exit-head bundles ("default-ee", OUT/exits of exit tuning)
    shipped = shipped_dir(src)  # models shipped in the package ("layerskip-code")
    if shipped is not None:
        loaded = (_load_delta(shipped, dtype, exits) if is_delta_dir(shipped)
                  else load_native(shipped, dtype=dtype, exits=exits))
        loaded.source = f"{src}:{shipped}"
    elif bundle is not None:
        base, bundle_exits = read_bundle(bundle)
        loaded = attach_heads(load_model(base, exits=bundle_exits), bundle, dtype=dtype,
                              exits=exits)
    elif src == "default":
        loaded = _load_default(dtype, exits, quant)
    elif path.is_file():
        if path.suffix == ".gguf":
            loaded = load_gguf(path, dtype=dtype, exits=exits, keep_quantized=quant)
        elif path.suffix in PICKLE_SUFFIXES:
            raise refuse_pickle(path)
        else:
            raise CheckpointError(
                f"{path}: cannot load a single {path.suffix or 'extensionless'} file; pass a "
                ".gguf file or a checkpoint directory (config.json + *.safetensors)"
            )
    elif path.is_dir():
        if is_delta_dir(path):
            loaded = _load_delta(path, dtype, exits)
        elif is_native_dir(path):
            loaded = load_native(path, dtype=dtype, exits=exits)
        elif is_megatron_dir(path):
            loaded = load_megatron(path, dtype=dtype, exits=exits)
        else:
            loaded = load_hf_dir(path, dtype=dtype, exits=exits)
    elif src in PRESETS:
        loaded = _load_preset(src, dtype, exits)
    else:
        names = ["default", *sorted(NAMED_BUNDLES), *shipped_names(), *sorted(PRESETS)]
        close = difflib.get_close_matches(src, names, n=1)
        raise CheckpointError(
            f"model {src!r} is not a known name, an existing .gguf file or a checkpoint "
            f"directory; known names: {', '.join(names)} (presets have random weights)",
            hint=f"did you mean {close[0]!r}?" if close else None,
        )
    if quant is not None:
        quantize_model(loaded.model, quant)
    if head_dtype is not None:
        quantize_heads(loaded.model, head_dtype)
    if torch.device(device) != torch.device("cpu"):
        loaded.model.to(device)
    return loaded


# ----- sources -------------------------------------------------------------------------------

def _load_delta(path: Path, dtype: torch.dtype, exits: ExitConfig | None) -> LoadedModel:
    """A low-rank delta (:mod:`exitlm.io.delta`) on top of the base it names."""
    meta, cfg = read_delta_meta(path)
    base = load_model(base_of(path, meta), exits=cfg.exits)
    return apply_delta(base, path, dtype=dtype, exits=exits)


def _load_preset(name: str, dtype: torch.dtype, exits: ExitConfig | None) -> LoadedModel:
    cfg = preset(name) if exits is None else preset(name, exits=exits)
    model = EarlyExitLM(cfg)
    cast_parameters(model, dtype)
    return LoadedModel(model.eval(), None, cfg, f"preset:{name}")


def load_native(
    path: Path, *, dtype: torch.dtype = torch.float32, exits: ExitConfig | None = None
) -> LoadedModel:
    """Load an exitlm directory (see :mod:`exitlm.io.native`)."""
    ckpt = native_config(path)
    files = weight_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file in files:
        for name, shape in tensor_shapes(file).items():
            shapes[name], where[name] = shape, str(file)
    source = str(files[0]) if len(files) == 1 else str(path)
    check_config_against_tensors(ckpt, shapes, source, files=where)
    cfg = ckpt if exits is None else ckpt.replace(exits=exits)
    model = model_from_tensors(
        cfg, keep_matching_exits(native_tensors(path), ckpt, cfg),
        source=source, dtype=dtype, allow_missing_exits=exits is not None,
        origin=lambda n: (where.get(n, source), [n]),
    )
    return LoadedModel(model, fill_special(load_tokenizer_dir(path), cfg), cfg, str(path))


def load_gguf(
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    exits: ExitConfig | None = None,
    name: str | None = None,
    progress: bool = False,
    keep_quantized: str | None = None,
) -> LoadedModel:
    """Load a GGUF file: dequantized weights (with ``keep_quantized="int8"|"int4"``: blocks
    of that precision or finer as quantized modules, see
    :func:`~exitlm.io.gguf_load.gguf_hf_tensors`) and the tokenizer from its metadata."""

    g = open_gguf(path)
    cfg = gguf_config(g, name=name)
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in g.reader.tensors}
    check_config_against_tensors(cfg, shapes, str(path), "the GGUF metadata")
    if exits is not None:
        cfg = cfg.replace(exits=exits)
    stream: Iterable[tuple[str, Any]] = gguf_hf_tensors(g, cfg, keep_quantized=keep_quantized)
    if progress:
        from tqdm import tqdm

        stream = tqdm(stream, total=len(g.reader.tensors), desc="dequantizing", unit="tensor",
                      leave=False, disable=None)
    model = model_from_tensors(
        cfg, hf_to_exitlm(stream, cfg, source=str(path)), source=str(path), dtype=dtype,
        allow_missing_exits=True,
        origin=lambda n: (str(path), [gguf_name(h) for h in hf_names(n, cfg)]),
    )
    return LoadedModel(model, gguf_tokenizer(g), cfg, str(path))


def _load_default(dtype: torch.dtype, exits: ExitConfig | None,
                  quant: str | None = None) -> LoadedModel:
    """The embedded model from its cache, converting the GGUF once. A quantized request
    (``quant``) has a cache of its own, made straight from the GGUF's blocks."""
    gguf = default_gguf_path()
    cache = cache_dir_for(gguf)
    if quant is not None:
        cache = cache.with_name(f"{cache.name}-{quant}")
    if cache.is_dir() and is_native_dir(cache) and (cache / "tokenizer.json").is_file():
        try:
            loaded = load_native(cache, dtype=dtype, exits=exits)
            loaded.source = f"default:{gguf}"
            return loaded
        except CheckpointError as err:
            progress_note(f"discarding unreadable cache {cache} ({err}); converting again")
            shutil.rmtree(cache, ignore_errors=True)
    progress_note(f"converting {gguf.name} once into {cache} (later loads are fast)")
    loaded = load_gguf(gguf, dtype=torch.float32, name=DEFAULT_NAME, progress=True,
                       keep_quantized=quant)
    if quant is not None:
        quantize_model(loaded.model, quant)
    try:
        save_native(loaded.model, cache, loaded.tokenizer)
    except OSError as err:
        # A concurrent process may have written the same cache first, or the cache
        # location is read-only: both leave a usable model in memory.
        if not (cache.is_dir() and is_native_dir(cache)):
            progress_note(f"could not write the cache {cache}: {err}")
    loaded.source = f"default:{gguf}"
    if exits is None and dtype == torch.float32:
        return loaded
    return rebuild(loaded, dtype=dtype, exits=exits)


# ----- helpers -------------------------------------------------------------------------------

