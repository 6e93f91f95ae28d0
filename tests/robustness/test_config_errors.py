"""Bad training configs, overrides and command-line values: one clear line naming the key and
the value, exit status 2, no traceback - and nothing allocated for absurd sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from _robust_util import ROOT, assert_clean_error, cli, cli_subprocess, run_config, tiny_checkpoint

from exitlm.config import ConfigError, ModelConfig
from exitlm.train.config import TrainConfig, load_config
from exitlm.train.presets import PRESETS

BAD_OVERRIDES = [
    ("train.steps=abc", ["train.steps", "'abc'"]),
    ("train.batch_size=2.5", ["train.batch_size: expected an integer >= 1, got 2.5"]),
    ("train.batch_size=0", ["train.batch_size", "got 0"]),
    ("model.overrides.foo=1", ["model.overrides", "foo"]),
    ("model.overrides.num_layers=abc", ["model.overrides.num_layers", "'abc'"]),
    ("model.overrides.tie_embeddings='false'", ["model.overrides.tie_embeddings", "'false'"]),
    ("model.overrides.num_kv_heads=3", ["num_kv_heads"]),
    ("optim.eps=-1", ["optim.eps", "-1"]),
    ("optim.lr=.inf", ["optim.lr", "inf"]),
    ("optim.lr=.nan", ["optim.lr", "nan"]),
    ("optim.beta2=1.0", ["optim.beta2", "1.0"]),
    ("train.seed=-1", ["train.seed", "-1"]),
    ("train.seed=100000000000000000000", ["train.seed", "100000000000000000000"]),
    ("dropout.p_max=2", ["dropout.p_max", "2"]),
    ("data.seq_len=1", ["data.seq_len", "got 1"]),
    ("data.paths={a: 1}", ["data.paths"]),
    ("model.exits.layers=[9]", ["exits.layers", "9"]),
    ("model.exits=yes", ["model.exits", "got True"]),
    ("model.exits='yes'", ["model.exits", "got 'yes'"]),
    ("model.exits.head=conv", ["model.exits.head", "'conv'"]),
    ("loss.kind=bogus", ["loss.kind", "'bogus'"]),
    ("loss.exit_weights=[a, b]", ["loss.exit_weights", "'a'"]),
    ("parallel.token_slices=[0, 3]", ["parallel.token_slices", "0"]),
    ("train.device=quantum", ["train.device", "'quantum'"]),
    ("train.amp=fp8", ["train.amp", "'fp8'"]),
    ("train.on_nonfinite=ignore", ["train.on_nonfinite", "'ignore'"]),
    ("bogus.key=1", ["bogus"]),
    ("train.steps", ["section.key=value"]),
    ("train.steps=[[[[", ["not valid YAML"]),
]


@pytest.mark.parametrize(("override", "needles"), BAD_OVERRIDES,
                         ids=[o for o, _ in BAD_OVERRIDES])
def test_bad_override_is_one_line(override: str, needles: list[str],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", "tiny", override, "--print-config"], capsys)
    line = assert_clean_error(res, *needles)
    assert "override" in line  # the command line, not the preset, is named as the culprit


def test_good_overrides_still_work(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", "tiny", "optim.lr=1e-3", "train.steps=3",
               "model.overrides.eos_token_ids=2", "loss.exit_weights=0.5", "--print-config"],
              capsys)
    assert res.rc == 0, res.err
    cfg = yaml.safe_load(res.out)
    assert cfg["optim"]["lr"] == 1e-3 and cfg["loss"]["exit_weights"] == [0.5]
    assert cfg["model"]["overrides"]["eos_token_ids"] == [2]


def _file(tmp_path: Path, content: bytes | str) -> Path:
    f = tmp_path / "cfg.yaml"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    return f


BAD_FILES = [
    ("binary", bytes(range(256)) * 4, ["not a UTF-8 text file"]),
    ("nul", b"train: {steps: 3}\x00\x00", ["NUL"]),
    ("list", "- 1\n- 2\n", ["mapping"]),
    ("scalar", "42\n", ["mapping"]),
    ("empty", "", ["cfg.yaml", "the config is empty"]),
    ("comments", "# nothing set yet\n", ["cfg.yaml", "the config is empty"]),
    ("empty-mapping", "{}\n", ["cfg.yaml", "the config is empty"]),
    ("false", "false\n", ["mapping", "bool"]),
    ("yaml", "train: {steps: [1, 2\n", ["not valid YAML"]),
    ("deep", "[" * 5000 + "]" * 5000, ["cfg.yaml"]),
    ("preset-list", "preset: [1]\n", ["unknown preset"]),
    ("section", "train: 5\n", ["train", "expected a mapping"]),
    ("key", "train: {stepz: 3}\n", ["unknown train keys", "stepz"]),
    ("value", "train: {steps: -3}\n", ["cfg.yaml", "train.steps", "-3"]),
]


@pytest.mark.parametrize(("name", "content", "needles"), BAD_FILES,
                         ids=[n for n, _, _ in BAD_FILES])
def test_bad_config_file_is_one_line(name: str, content: bytes | str, needles: list[str],
                                     tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["train", "--config", _file(tmp_path, content), "--print-config"], capsys)
    assert_clean_error(res, *needles)


def test_config_that_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_clean_error(cli(["train", "--config", tmp_path], capsys), "is not a file")


def test_file_or_override_is_blamed(tmp_path: Path) -> None:
    f = _file(tmp_path, "train: {steps: -3}\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml: train\.steps"):
        load_config(str(f))
    with pytest.raises(ConfigError, match=r"^override: train\.batch_size"):
        load_config(str(_file(tmp_path, "train: {steps: 3}\n")), ["train.batch_size=0"])
    # an override may fix a bad file value
    assert load_config(str(f), ["train.steps=4"]).train.steps == 4


def test_out_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path)
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(cfg.to_dict()))
    res = cli(["train", "--config", file, f"train.out_dir={f}"], capsys)
    assert_clean_error(res, "train.out_dir", str(f), "is a file")
    assert f.read_text() == "keep me"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cuda_device_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(run_config(tmp_path).to_dict()))
    res = cli(["train", "--config", file, "train.device=cuda"], capsys)
    assert_clean_error(res, "train.device='cuda'", "no CUDA device")


def test_absurd_model_size_fails_before_allocating(tmp_path: Path) -> None:
    """10 million layers: refused from the config alone, in a process limited to 3 GiB."""
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(run_config(tmp_path).to_dict()))
    res = cli_subprocess(["train", "--config", file, "model.overrides.num_layers=10000000"],
                         timeout=60)
    assert_clean_error(res, "10000000 layers", "GiB")
    assert not (tmp_path / "run").exists()


def test_model_config_from_json_names_key_and_value() -> None:
    cases = {
        "num_layers": ("abc", "num_layers: expected an integer >= 1, got 'abc'"),
        "head_dim": (-16, "head_dim: expected an integer >= 1 or null, got -16"),
        "exits": ("yes", "exits: expected a mapping of ExitConfig settings, got 'yes'"),
        "tie_embeddings": ("false", "tie_embeddings: expected true or false, got 'false'"),
        "norm_eps": (float("nan"), "norm_eps: expected a number in (0, 1), got nan"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ConfigError) as info:
            ModelConfig.from_dict({key: value}, "config.json")
        assert str(info.value) == f"config.json: {message}"


EVAL_ERRORS = [
    (["--batch-size", "0"], ["--batch-size", "expected an integer >= 1, got 0"]),
    (["--batch-size", "x"], ["--batch-size", "'x'"]),
    (["--seq-len", "1"], ["--seq-len"]),
    (["--max-samples", "-2"], ["--max-samples"]),
    (["--topk", "0"], ["--topk"]),
    (["--seq-len", "100000"], ["--seq-len 100000", "max_seq_len=256"]),
    (["--layers", "0,9"], ["--layers", "1..4"]),
    (["--layers", "a"], ["--layers", "'a'"]),
    (["--data", "/nonexistent/x.txt"], ["--data: /nonexistent/x.txt", "does not exist"]),
    (["--data", "/dev/zero"], ["--data: /dev/zero", "not a regular file or directory"]),
]


@pytest.mark.parametrize(("args", "needles"), EVAL_ERRORS,
                         ids=[" ".join(a) for a, _ in EVAL_ERRORS])
def test_eval_arguments(args: list[str], needles: list[str],
                        capsys: pytest.CaptureFixture[str]) -> None:
    assert_clean_error(cli(["eval", "debug", *args], capsys), *needles)


def test_eval_tokenizer_larger_than_the_model(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import tokenizers

    vocab = {f"t{i}": i for i in range(300)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tk.save(str(tmp_path / "tokenizer.json"))
    res = cli(["eval", "debug", "--tokenizer", tmp_path], capsys)
    assert_clean_error(res, "300 tokens", "vocabulary has 256")


def test_eval_data_shorter_than_one_sample_names_the_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "short.txt").write_text("ten bytes.")
    res = cli(["eval", "debug", "--data", tmp_path / "short.txt", "--seq-len", "64"], capsys)
    line = assert_clean_error(res, "--data", "--seq-len=64")
    assert "data.seq_len" not in line and "data.paths" not in line


def _sparse_tokenizer(directory: Path) -> Path:
    """A 27-token tokenizer whose ids run up to 325 (past a 256-token model's vocabulary)."""
    import tokenizers

    vocab = {"[UNK]": 0, **{chr(ord("a") + i): 300 + i for i in range(26)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    directory.mkdir(parents=True, exist_ok=True)
    tk.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_eval_tokenizer_ids_past_the_vocab(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Few tokens but large ids: refused before any id reaches the embedding, whether the
    tokenizer is the model directory's own or given with --tokenizer."""
    file = _sparse_tokenizer(tmp_path / "tok")
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_bytes(file.read_bytes())
    data = ["--threads", "1", "--max-samples", "2", "--seq-len", "16", "--data", ROOT / "README.md"]
    for args in (["eval", ckpt, *data], ["eval", "debug", "--tokenizer", tmp_path / "tok", *data]):
        line = assert_clean_error(cli(args, capsys), "tokenizer.json",
                                  "token ids up to 325 exceed the model's vocab_size 256")
        assert str(file) in line or str(ckpt / "tokenizer.json") in line


def test_train_tokenizer_ids_past_the_vocab(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _sparse_tokenizer(tmp_path / "tok")
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(run_config(tmp_path).to_dict()))
    res = cli(["train", "--config", file, f"data.tokenizer={tmp_path / 'tok'}"], capsys)
    assert_clean_error(res, "data.tokenizer=", "token ids up to 325 exceed the model's "
                       "vocab_size 256")
    assert not (tmp_path / "cache").exists()  # refused before the corpus is tokenized


def test_eval_default_tokenizer_on_a_byte_model(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: ``--tokenizer default`` (49152 tokens) on a 256-token model."""
    from _default_model import has_default_model

    if not has_default_model():
        pytest.skip("needs the embedded model")
    res = cli(["eval", "debug", "--tokenizer", "default"], capsys)
    assert_clean_error(res, "49152 tokens", "vocabulary has 256")


GENERATE_ERRORS = [
    (["--logprobs", "3"], ["--logprobs 3", "--json"]),
    (["--dist-timeout", "-1"], ["--dist-timeout", "'-1'", ">= 1"]),
    (["--dist-timeout", "0.001"], ["--dist-timeout", "'0.001'", ">= 1"]),
    (["--strategy", "early-exit", "--kv", "pipeline", "--stages", "0"], ["--stages:", "got 0"]),
    (["--strategy", "self-spec", "--num-speculations", "0"], ["--num-speculations:", "got 0"]),
    (["--dist-timeout", "nan"], ["--dist-timeout", "'nan'"]),
]


@pytest.mark.parametrize(("args", "needles"), GENERATE_ERRORS,
                         ids=[" ".join(a) for a, _ in GENERATE_ERRORS])
def test_generate_arguments(args: list[str], needles: list[str],
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Values that were silently ignored or accepted are refused."""
    res = cli(["generate", "hi", "--model", "debug", "--max-new-tokens", "2", *args], capsys)
    assert_clean_error(res, *needles)


TOO_MANY_THREADS = [
    ["generate", "hi", "--model", "debug", "--max-new-tokens", "2"],
    ["eval", "debug"],
    ["bench", "--model", "debug", "--strategies", "ar"],
    ["lm-eval", "--tasks", "x"],
    ["humaneval"],
    ["plan", "terapipe", "--model", "debug", "--stages", "2"],
]


@pytest.mark.parametrize("args", TOO_MANY_THREADS, ids=[a[0] for a in TOO_MANY_THREADS])
@pytest.mark.parametrize("threads", ["100000", "2000"])
def test_every_threads_flag_is_bounded(args: list[str], threads: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Thousands of threads crashed torch's pool (a segfault): refused before any start."""
    from exitlm.args import max_threads

    res = cli([*args, "--threads", threads], capsys)
    assert_clean_error(res, "--threads", f"[1, {max_threads()}]", threads)


BENCH_COUNTS = [("--num-prompts", "0"), ("--num-prompts", "-3"), ("--repeats", "0"),
                ("--repeats", "-1")]


@pytest.mark.parametrize(("flag", "value"), BENCH_COUNTS)
def test_bench_counts_must_be_positive(flag: str, value: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["bench", "--model", "debug", "--strategies", "ar", flag, value], capsys)
    assert_clean_error(res, flag, value)


def test_unknown_command_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert_clean_error(cli(["frobnicate"], capsys), "frobnicate")
    assert_clean_error(cli(["train", "--config", "tiny", "--resumee"], capsys), "--resumee")


def test_debug_flag_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["--debug", "train", "--config", "tiny", "train.steps=abc", "--print-config"],
              capsys)
    assert res.rc == 2 and "Traceback" in res.err and "train.steps" in res.err


PLAN_ERRORS = [
    (["ppd", "--layers", "0", "--exit-layer", "1", "--k", "1", "--tokens", "4",
      "--p-correct", "0.5"], ["--layers", "got 0"]),
    (["ppd", "--layers", "30", "--exit-layer", "nan", "--k", "1", "--tokens", "4",
      "--p-correct", "0.5"], ["--exit-layer", "'nan'"]),
    (["ppd", "--layers", "30", "--exit-layer", "20", "--k", "1", "--tokens", "64",
      "--p-correct", "0.5", "--monte-carlo", "1000000000"], ["--monte-carlo 1000000000"]),
    (["pipeline", "--stages", "100000", "--microbatches", "100000", "--times",
      "1,1,1,1,1,1,1,1"], ["--stages 100000 x --microbatches 100000"]),
    (["pipeline", "--stages", "2", "--microbatches", "4", "--times", "1,1"], ["--times"]),
    (["terapipe", "--model", "debug", "--seq-len", "100000000", "--stages", "2"],
     ["--seq-len 100000000", "GiB"]),
]


@pytest.mark.parametrize(("args", "needles"), PLAN_ERRORS, ids=[a[0] for a, _ in PLAN_ERRORS])
def test_plan_arguments(args: list[str], needles: list[str],
                        capsys: pytest.CaptureFixture[str]) -> None:
    """Sizes that would take unbounded time or memory are refused up front."""
    assert_clean_error(cli(["plan", *args], capsys), *needles)


def test_plan_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "model.json"
    f.write_text('{"num_layers": 10000000}')
    res = cli(["plan", "pipeline", "--stages", "2", "--microbatches", "2", "--model", f], capsys)
    assert_clean_error(res, "10000000 layers")
    f.write_bytes(b"\xff\xfe binary")
    res = cli(["plan", "pipeline", "--stages", "2", "--microbatches", "2", "--model", f], capsys)
    assert_clean_error(res, str(f), "not UTF-8")


def test_preset_name_beside_a_folder_of_that_name(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``--config tiny`` is the preset, also where the working directory holds a folder
    named ``tiny`` (a run's output, say)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert load_config("tiny").to_dict() == TrainConfig.from_dict(PRESETS["tiny"]).to_dict()
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(str(tmp_path / "tiny"))


@pytest.mark.parametrize(("override", "key"), [("train.batch_size=1000000000", "train.batch_size"),
                                               ("train.grad_accum=1000000000", "train.grad_accum")])
def test_absurd_batch_fails_before_allocating(override: str, key: str, tmp_path: Path) -> None:
    """A step of 10^9 rows (or micro-batches, all built before the step): refused from the
    config, in a process limited to 3 GiB, before the run directory is made."""
    file = tmp_path / "cfg.yaml"
    file.write_text(yaml.safe_dump(run_config(tmp_path).to_dict()))
    res = cli_subprocess(["train", "--config", file, override], timeout=60)
    assert_clean_error(res, f"{override.split('=')[0]}=1000000000", "GiB", "data.seq_len=32")
    assert key in res.err and not (tmp_path / "run").exists()


def test_batch_memory_estimate_accepts_ordinary_steps() -> None:
    from exitlm.config import check_batch_fits_in_memory, preset, training_step_bytes

    cfg = preset("debug")
    check_batch_fits_in_memory(cfg, 8, 4, 256)
    one = training_step_bytes(cfg, 8, 1, 256)
    assert training_step_bytes(cfg, 8, 1000, 256) - one == 999 * 8 * 256 * 16  # the buffers
