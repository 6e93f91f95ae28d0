"""Property-based tests: every generated config, ``config.json`` or command line either works
or fails with an :class:`~exitlm.errors.ExitlmError` (one clean line at the CLI) - never another
exception, a traceback, or unbounded work."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from _robust_util import Result, assert_clean_error, tiny_checkpoint
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from exitlm.cli import main
from exitlm.config import ExitConfig, ModelConfig
from exitlm.errors import ExitlmError
from exitlm.io import export_hf, load_model
from exitlm.schema import _unwrap, field_hints
from exitlm.train.config import _SECTIONS, TrainConfig

# A fixed, quick sample by default; EXITLM_PROPERTY_EXAMPLES=N explores N random examples
# per test instead (a deeper search, e.g. before a release).
_DEEP = int(os.environ.get("EXITLM_PROPERTY_EXAMPLES", "0"))
PROPS = settings(deadline=None, derandomize=not _DEEP, max_examples=_DEEP or 60,
                 suppress_health_check=[HealthCheck.too_slow])

WORDS = ["rmsnorm", "layernorm", "rope", "learned", "swiglu", "gelu", "silu", "relu",
         "linear", "mlp", "block", "own", "final", "none", "final_head", "tied_embedding",
         "auto", "cpu", "ee-llm", "layerskip", "1f1b", "gpipe", "exp", "rotational", "1e-3",
         "warmup", "cooldown", "cosine", "bytes", "error", "skip", "true", "yes", "0x10"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.integers(-10**30, 10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(WORDS), st.text(max_size=8),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def plausible(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the type ``hint`` asks for, mostly within its range (some will still be
    refused by checks across settings)."""
    base, rng = _unwrap(hint)
    origin = typing.get_origin(base)
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        return st.one_of(*[plausible(a) for a in typing.get_args(base)])
    if base is type(None):
        return st.none()
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(base))
    if origin is tuple:
        return st.lists(plausible(typing.get_args(base)[0]), max_size=3)
    if base is bool:
        return st.booleans()
    if base is int:
        low = int(rng.ge if rng is not None and rng.ge is not None else -2)
        return st.integers(low, low + 8)
    if base is float:
        return st.floats(1e-6, 0.99) if rng is not None else st.floats(-2, 2)
    if base is str:
        return st.sampled_from(WORDS)
    if dataclasses.is_dataclass(base):
        return st.dictionaries(st.sampled_from(sorted(field_hints(base))), VALUES, max_size=2)
    return VALUES


def _mapping_of(cls: type, extra_keys: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    hints = field_hints(cls)
    known = st.sampled_from(sorted(hints)).flatmap(
        lambda k: st.tuples(st.just(k), st.one_of(plausible(hints[k]), plausible(hints[k]),
                                                  VALUES)))
    pairs = st.one_of(known, known, known, st.tuples(st.text(max_size=6), VALUES)) \
        if extra_keys else known
    return st.lists(pairs, max_size=4).map(dict)


def _run(args: list[str]) -> Result:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as stop:
            rc = int(stop.code or 0)
    return Result(rc, out.getvalue(), err.getvalue())


def _works_or_exitlm_error(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except ExitlmError as err:
        assert str(err).strip(), "an error needs a message"
        return None


@PROPS
@given(_mapping_of(ModelConfig))
def test_model_config_from_dict(d: dict[str, Any]) -> None:
    cfg = _works_or_exitlm_error(ModelConfig.from_dict, d)
    event("valid" if cfg is not None else "refused")
    if cfg is not None:
        assert ModelConfig.from_json(cfg.to_json()) == cfg
        assert isinstance(cfg.num_layers, int) and cfg.num_layers >= 1
        assert all(isinstance(x, int) for x in cfg.exits.layers)


@PROPS
@given(_mapping_of(ExitConfig))
def test_exit_config(d: dict[str, Any]) -> None:
    _works_or_exitlm_error(lambda: ModelConfig.from_dict({"exits": d}))


SECTION = st.sampled_from(sorted(_SECTIONS)).flatmap(
    lambda name: st.tuples(st.just(name), _mapping_of(_SECTIONS[name])))


@PROPS
@given(st.lists(SECTION, max_size=3), st.dictionaries(st.text(max_size=5), VALUES, max_size=1))
def test_train_config_from_dict(sections: list[tuple[str, dict[str, Any]]],
                                junk: dict[str, Any]) -> None:
    d: dict[str, Any] = {name: body for name, body in sections}
    if junk and not sections:
        d.update(junk)
    cfg = _works_or_exitlm_error(TrainConfig.from_dict, d)
    if cfg is not None:
        assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def _dotted_keys() -> list[str]:
    keys = [f"{name}.{field}" for name, kind in _SECTIONS.items() for field in field_hints(kind)]
    keys += [f"model.overrides.{k}" for k in field_hints(ModelConfig)]
    keys += [f"model.exits.{k}" for k in field_hints(ExitConfig)]
    return sorted(keys)


def _hint_of(key: str) -> Any:
    parts = key.split(".")
    if len(parts) == 3 and parts[:2] == ["model", "overrides"]:
        return field_hints(ModelConfig)[parts[2]]
    if len(parts) == 3 and parts[:2] == ["model", "exits"]:
        return field_hints(ExitConfig)[parts[2]]
    return field_hints(_SECTIONS[parts[0]])[parts[1]]


KNOWN_OVERRIDE = st.sampled_from(_dotted_keys()).flatmap(lambda k: st.tuples(
    st.just(k), st.one_of(plausible(_hint_of(k)), VALUES).map(
        lambda v: json.dumps(v, allow_nan=True))))
OVERRIDE = st.one_of(
    KNOWN_OVERRIDE, KNOWN_OVERRIDE,
    st.tuples(st.text(max_size=10), st.text(max_size=10)),
).map(lambda kv: f"{kv[0]}={kv[1]}")


@PROPS
@given(st.lists(OVERRIDE, min_size=1, max_size=3))
def test_train_cli_overrides(overrides: list[str]) -> None:
    """``exitlm train --config tiny k=v ... --print-config``: 0, or one clean error line."""
    res = _run(["train", "--config", "tiny", *overrides, "--print-config"])
    event(f"exit status {res.rc}")
    if res.rc != 0:
        assert_clean_error(res)


@pytest.fixture(scope="module")
def checkpoints_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("props")
    native = tiny_checkpoint(root / "native")
    hf = export_hf(load_model(str(native)), root / "hf")
    return {"native": native, "hf": hf}


HF_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings",
           "rms_norm_eps", "rope_theta", "rope_scaling", "hidden_act", "attention_bias",
           "mlp_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
           "architectures", "model_type"]


@settings(PROPS, max_examples=_DEEP or 40)
@given(fmt=st.sampled_from(["native", "hf"]), data=st.data())
def test_checkpoint_config_json(fmt: str, data: st.DataObject,
                                checkpoints_dir: dict[str, Path], tmp_path_factory: Any
                                ) -> None:
    """A checkpoint whose config.json got random keys and values: ``load_model`` and
    ``exitlm info`` either load it or fail with one line, in bounded time."""
    src = checkpoints_dir[fmt]
    if fmt == "native":
        changes = data.draw(_mapping_of(ModelConfig, extra_keys=False).filter(bool))
    else:
        changes = data.draw(st.dictionaries(st.sampled_from(HF_KEYS), st.one_of(
            VALUES, st.integers(1, 64)), min_size=1, max_size=3))
    ckpt = tmp_path_factory.mktemp("c") / "ckpt"
    shutil.copytree(src, ckpt)
    file = ckpt / "config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg, allow_nan=True))
    loaded = _works_or_exitlm_error(load_model, str(ckpt))
    event("loads" if loaded is not None else "refused")
    if loaded is not None:
        assert loaded.config.num_layers == 2  # whatever loads matches the weights
    res = _run(["info", ckpt, "--json"])
    assert res.rc == (0 if loaded is not None else 2), res.err
    if res.rc:
        assert_clean_error(res)
    shutil.rmtree(ckpt.parent)


@settings(PROPS, max_examples=_DEEP or 30)
@given(args=st.lists(st.tuples(
    st.sampled_from(["--batch-size", "--seq-len", "--max-samples", "--topk", "--layers"]),
    st.one_of(st.integers(1, 64).map(str), st.integers(-2, 300).map(str), st.text(max_size=5),
              st.sampled_from(["all", "1,2", "0", "4,4", "10**9", "nan"]))), max_size=3))
def test_eval_cli_arguments(args: list[tuple[str, str]], checkpoints_dir: dict[str, Path]
                            ) -> None:
    data = checkpoints_dir["native"].parent / "text.txt"
    if not data.is_file():
        data.write_text("def f(x):\n    return x + 1\n" * 40)
    flat = [x for pair in args for x in pair]
    res = _run(["eval", checkpoints_dir["native"], "--data", data, "--max-samples", "2", *flat])
    event(f"exit status {res.rc}")
    if res.rc != 0:
        assert_clean_error(res)
    else:
        assert "ppl" in res.out


def test_values_round_trip_exactly() -> None:
    """Floats given as strings (YAML's 1e-3) and ints where floats are expected convert."""
    cfg = TrainConfig.from_dict({"optim": {"lr": "1e-3", "eps": 1}, "loss": {"exit_weights": 1}})
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.eps, float)
    assert cfg.loss.exit_weights == (1.0,)
    assert not math.isnan(cfg.optim.lr)
