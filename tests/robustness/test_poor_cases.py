"""The remaining poor cases of issue 32, each one clear line and a non-zero exit (or correct
behaviour): a rank that cannot meet the others, sampling from NaN weights, ``--chat`` without
a template, a mistyped model name, the saved-evaluations gauge, PPD's worker start."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from _robust_util import assert_clean_error, cli, cli_subprocess, tiny_checkpoint, tiny_model

from _train_util import tiny_config
from exitlm.infer import generate
from exitlm.infer.result import DecodeStats
from exitlm.io import save_model
from exitlm.serve.metrics import Metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_that_cannot_meet_the_others_names_itself_and_the_store(tmp_path: Path) -> None:
    """Rank 1 of a torchrun job whose rank 0 never started (stopped during start-up)."""
    port = _free_port()
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    res = cli_subprocess(["generate", "hi", "--model", tiny_checkpoint(tmp_path / "m"),
                          "--tp", "2", "--dist-timeout", "2", "--max-new-tokens", "2"],
                         env=env, timeout=240)
    # one line: none of c10d's retry logs and their ~40 lines of C++ frames
    assert_clean_error(res, "rank 1 of 2", f"127.0.0.1:{port}")
    assert "frame #" not in res.err and "[c10d]" not in res.err, res.err[-2000:]


def test_a_rank_whose_master_port_another_program_holds_gives_up(tmp_path: Path) -> None:
    """Rank 1 of an env-launched ``train`` whose MASTER_PORT an unrelated program listens on
    (it accepts and never answers): torch waits for the store's answer forever; exitlm gives
    up after 2 x parallel.timeout_s + 10 s, naming MASTER_ADDR:MASTER_PORT."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path).to_dict()))
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    port = squatter.getsockname()[1]
    held: list[socket.socket] = []

    def hold() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(squatter.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        res = cli_subprocess(["train", "--config", config, "parallel.timeout_s=2",
                              f"train.out_dir={tmp_path / 'run'}"], env=env, timeout=240)
    finally:
        squatter.close()
        for c in held:
            c.close()
    assert held, "rank 1 never connected to the port"
    assert_clean_error(res, "rank 1 of 2", f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}",
                       "parallel.timeout_s", "expected rank 0's torch.distributed store")


def _nan_checkpoint(path: Path) -> Path:
    model = tiny_model()
    with torch.no_grad():
        model.layers[1].mlp.w_out.weight.fill_(float("nan"))
    return save_model(model, path)


def test_sampling_from_nan_weights_is_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    model = _nan_checkpoint(tmp_path / "nan")
    for strategy in ("ar", "self-spec"):
        res = cli(["generate", "hi", "--model", model, "--temperature", "0.8", "--strategy",
                   strategy, "--max-new-tokens", "3"], capsys)
        assert_clean_error(res, "cannot sample", "NaN or infinite", "non-finite weights")
        assert "exitlm: warning:" in res.err  # the load warning came first


def test_chat_without_a_template_is_refused_unless_one_is_chosen(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_checkpoint(tmp_path / "m")  # byte fallback tokenizer: no template
    res = cli(["generate", "hi", "--model", model, "--chat", "--max-new-tokens", "2"], capsys)
    assert_clean_error(res, "--chat", "no chat template")
    assert "--chat-template" in res.err
    res = cli(["generate", "hi", "--model", model, "--chat", "--chat-template", "chatml",
               "--max-new-tokens", "2", "--json"], capsys)
    assert res.rc == 0, res.err
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    res = cli(["generate", "hi", "--model", model, "--chat", "--chat-template", template,
               "--max-new-tokens", "2", "--json"], capsys)
    assert res.rc == 0, res.err
    res = cli(["generate", "hi", "--model", model, "--chat", "--chat-template",
               tmp_path / "missing.jinja"], capsys)
    assert_clean_error(res, "--chat-template", "missing.jinja", "cannot read")
    res = cli(["generate", "hi", "--model", model, "--chat-template", "chatml"], capsys)
    assert_clean_error(res, "--chat-template applies to --chat")


def test_a_mistyped_model_name_lists_every_known_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.chdir(tmp_path)  # no directory of that name here
    res = cli(["generate", "hi", "--model", "defualt-ee"], capsys)
    line = assert_clean_error(res, "'defualt-ee'", "default-ee", "default,", "debug")
    assert "did you mean 'default-ee'" in res.err, line


def _update(spent: int, tokens: int) -> SimpleNamespace:
    request = SimpleNamespace(finish_reason="length", prompt_ids=[1], token_ids=[0] * tokens,
                              layer_evaluations=spent, prompt_copied=0, stats=DecodeStats(),
                              t_submit=0.0, t_first=0.0, t_end=0.0)
    return SimpleNamespace(token_ids=[], exit_layers=[], finished=True, request=request)


def _gauges(metrics: Metrics) -> tuple[float, float]:
    reg = metrics.registry
    return (reg.get_sample_value("exitlm_layer_evaluations_saved") or 0.0,
            reg.get_sample_value("exitlm_layer_evaluations_extra") or 0.0)


def test_saved_layer_evaluations_never_go_negative() -> None:
    metrics = Metrics(4, DecodeStats, lambda: 0.0, lambda: 0.0, lambda: 0.0)
    metrics.observe(_update(spent=30, tokens=5))  # speculation: 30 spent, plain: 20
    assert _gauges(metrics) == (0.0, 10.0)
    metrics.observe(_update(spent=10, tokens=10))  # early exits: 10 spent, plain: 40
    assert _gauges(metrics) == (20.0, 0.0)  # 40 spent of 60: 20 saved overall


def test_the_ppd_worker_start_is_not_prefill_time() -> None:
    model = tiny_model(exits=(1,))
    prompt = [[5, 6, 7]]
    threads = generate(model, None, prompt, strategy="ppd", ppd_layer=1,
                       max_new_tokens=3).timings
    assert threads.startup_s == 0.0
    proc = generate(model, None, prompt, strategy="ppd", ppd_layer=1, ppd_workers="process",
                    max_new_tokens=3).timings
    assert proc.startup_s > 0.0
    assert proc.prefill_s + proc.startup_s <= proc.total_s
    assert "startup_s" in proc.to_dict()
