"""The lm-evaluation-harness adapter: on an offline multiple-choice task (local JSON data) it
gives the same accuracy and per-example log-likelihoods as lm-eval's own ``hf`` model on the
Hugging Face export of the same weights; rolling log-likelihoods agree too; generation runs
through the engine with every strategy (lossless ones give AR's text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from _tiny import byte_tokenizer, tiny_text_model  # noqa: E402
from exitlm.config import ExitConfig  # noqa: E402
from exitlm.eval.lm_eval_adapter import ExitlmLM  # noqa: E402

QUESTIONS = [
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Two plus two is", ["four", "five"], 0),
    ("Water is", ["wet", "dry", "square", "late"], 0),
    ("Fire is", ["cold", "hot"], 1),
    ("", ["a", "b"], 1),
    ("Cats say ", ["meow", "moo"], 0),
]

TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(root: Path) -> Path:
    """A local multiple-choice task: JSON lines + a task YAML (how the README says to)."""
    data = root / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS), encoding="utf-8")
    (root / "tiny_mc.yaml").write_text(TASK_YAML.format(data=data), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A tiny model with every-layer exits, its tokenizer and its Hugging Face export."""
    from exitlm.io.save import export_hf

    torch.manual_seed(0)
    model = tiny_text_model()
    tok = byte_tokenizer()
    hf = export_hf(model, tmp_path_factory.mktemp("hf") / "model", tok)
    return model, tok, hf


def _per_sample(results: dict) -> list[list[float]]:
    """Each document's per-choice log-likelihoods (``resps``: one ``[(ll, greedy)]`` each)."""
    return [[float(r[0][0]) for r in s["resps"]] for s in
            sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])]


def test_multiple_choice_parity_with_lm_eval_hf(tiny: tuple, tmp_path: Path) -> None:
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model, tok, hf_dir = tiny
    tasks = TaskManager(include_path=str(write_task(tmp_path)))
    ours = lm_eval.simple_evaluate(model=ExitlmLM(model, tok, batch_size=4), tasks=["tiny_mc"],
                                   task_manager=tasks, log_samples=True)
    hf = HFLM(pretrained=str(hf_dir), batch_size=4, device="cpu", dtype="float32")
    theirs = lm_eval.simple_evaluate(model=hf, tasks=["tiny_mc"], task_manager=tasks,
                                     log_samples=True)
    a, b = _per_sample(ours), _per_sample(theirs)
    assert len(a) == len(QUESTIONS)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, abs=2e-4)
    acc = ours["results"]["tiny_mc"]["acc,none"]
    assert acc == theirs["results"]["tiny_mc"]["acc,none"]
    # scoring at an exit uses that exit (another number), selected by layer=
    at1 = lm_eval.simple_evaluate(model=ExitlmLM(_every_layer(model), tok, layer=1),
                                  tasks=["tiny_mc"], task_manager=tasks, log_samples=True)
    flat = [x for doc in a for x in doc]
    assert [x for doc in _per_sample(at1) for x in doc] != pytest.approx(flat, abs=1e-3)


def _every_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights with LayerSkip exits at every layer (through the final norm + head)."""
    ee = model.__class__(model.config.replace(exits=ExitConfig(every_layer=True, norm="final")))
    ee.load_state_dict(model.state_dict(), strict=False)
    return ee.eval()


def test_rolling_loglikelihood_matches_lm_eval_hf(tiny: tuple) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok, hf_dir = tiny
    texts = ["hello world, this is a longer text than the window", "short"]
    reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    ours = ExitlmLM(model, tok, max_length=16).loglikelihood_rolling(reqs, disable_tqdm=True)
    hf = HFLM(pretrained=str(hf_dir), batch_size=2, device="cpu", dtype="float32",
              max_length=16)
    theirs = hf.loglikelihood_rolling(reqs, disable_tqdm=True)
    assert ours == pytest.approx(theirs, abs=2e-4)


@pytest.mark.parametrize(("strategy", "opts"),
                         [("self-spec", {"exit_layer": 1}), ("early-exit", {"threshold": 1.0})])
def test_generate_until_through_the_engine(tiny: tuple, strategy: str, opts: dict) -> None:
    from lm_eval.api.instance import Instance

    model, tok, _ = tiny
    ee = _every_layer(model)
    reqs = [Instance("generate_until", {}, (c, {"until": ["x"], "max_gen_toks": n}), i)
            for i, (c, n) in enumerate([("abc", 12), ("hello", 20), ("q", 5)])]
    ar = ExitlmLM(ee, tok).generate_until(reqs, disable_tqdm=True)
    got = ExitlmLM(ee, tok, strategy=strategy, **opts).generate_until(reqs, disable_tqdm=True)
    assert got == ar
    assert all("x" not in t for t in got)
    assert len(ar[2]) <= 5  # one byte per token: at most 5 characters


def test_cli_wraps_lm_evals_own(tiny: tuple, tmp_path: Path,
                                capsys: pytest.CaptureFixture) -> None:
    """``exitlm lm-eval`` runs lm-eval's command line with ``--model exitlm``: strategy
    options travel as a JSON object (lists included), results land in --output-path (given
    here in lm-eval's own spelling); task indexing is reported as a phase."""
    from exitlm.cli import build_parser, main
    from exitlm.eval.cli import lm_eval_argv
    from exitlm.io import save_model

    model, tok, _ = tiny
    model_dir = save_model(_every_layer(model), tmp_path / "m", tok)
    args = build_parser().parse_args(
        ["lm-eval", "--model", str(model_dir), "--strategy", "early-exit", "--exit-layers",
         "1", "--threshold", "0.5", "--tasks", "tiny_mc", "--limit", "3", "--", "--seed", "1"])
    argv = lm_eval_argv(args)
    model_args = json.loads(argv[argv.index("--model_args") + 1])
    assert model_args["exit_layers"] == [1] and model_args["threshold"] == 0.5
    assert argv[-2:] == ["--seed", "1"]
    out = tmp_path / "out"
    rc = main(["lm-eval", "--model", str(model_dir), "--tasks", "tiny_mc", "--include_path",
               str(write_task(tmp_path)), "--limit", "3", "--output_path", str(out)])
    assert rc == 0
    assert "exitlm: indexing lm-eval's tasks..." in capsys.readouterr().err
    result = json.loads(next(out.rglob("results_*.json")).read_text())
    assert result["results"]["tiny_mc"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
