"""The embedded SmolLM2-135M-Instruct: GGUF loading against transformers' own GGUF loader.

One module-scoped conversion (into a temporary cache) and one transformers model/tokenizer are
shared by all tests here.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from _default_model import requires_default_model
from exitlm.io import LoadedModel, load_model

pytestmark = [pytest.mark.real_model, requires_default_model]

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Source files in which no whitespace run precedes a digit (see test_digit_split below).
SAME_FILES = ("textwrap.py", "json/decoder.py", "os.py")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("exitlm-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("EXITLM_CACHE", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def ours(cache: Path) -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from exitlm.io.default_model import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                      gguf_file=gguf_path.name)


def test_config_and_special_tokens(ours: LoadedModel) -> None:
    cfg, tok = ours.config, ours.tokenizer
    assert cfg.name == "smollm2-135m-instruct"
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert cfg.rope_theta == 100000.0 and cfg.tie_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 2)
    assert tok is not None and tok.add_bos is False
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2,), 2)


def test_cache_is_reused(ours: LoadedModel, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import exitlm.io.loader as loader

    assert len(list((cache / "gguf").iterdir())) == 1

    def no_gguf(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was converted again instead of read from the cache")

    monkeypatch.setattr(loader, "load_gguf", no_gguf)
    again = load_model("default")
    assert again.config == ours.config
    for (n, a), (_, b) in zip(ours.model.state_dict().items(),
                              again.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert again.tokenizer is not None and ours.tokenizer is not None
    assert again.tokenizer.encode("Hello 2024!") == ours.tokenizer.encode("Hello 2024!")


@pytest.mark.slow  # transformers' GGUF loader alone takes 20-40 s here (it reads the file twice)
def test_logits_match_transformers_gguf_loader(ours: LoadedModel, gguf_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()
    assert ours.tokenizer is not None
    text = (STDLIB / "textwrap.py").read_text()[:400]
    tokens = torch.tensor([ours.tokenizer.encode(text)[:96]])
    with torch.no_grad():
        torch.testing.assert_close(ours.model(tokens).logits, ref(tokens).logits,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", SAME_FILES)
def test_tokenizer_matches_transformers_on_stdlib(ours: LoadedModel, hf_tokenizer: Any,
                                                  name: str) -> None:
    text = (STDLIB / name).read_text()
    assert ours.tokenizer is not None
    ids = ours.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.tokenizer.decode(ids) == text


def test_digit_split(ours: LoadedModel, hf_tokenizer: Any) -> None:
    """SmolLM2 (``tokenizer.ggml.pre = smollm``) splits every digit off before the byte-level
    split, as its original tokenizer.json and llama.cpp do. transformers' GGUF loader has no
    rule for ``smollm`` and keeps GPT-2's split, which differs only where whitespace precedes
    a digit; with the smollm rule put in, it agrees with us everywhere."""
    from exitlm.io.gguf_tokenizer import pre_tokenizer_for

    tok = ours.tokenizer
    assert tok is not None
    assert [tok.tk.id_to_token(i) for i in tok.encode("[\n    1]")] == ["[", "ĊĠĠĠĠ", "1", "]"]
    backend = hf_tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizer_for("smollm")
    for name in ("datetime.py", "locale.py"):
        text = (STDLIB / name).read_text()
        assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_chat_template_matches_transformers(ours: LoadedModel, hf_tokenizer: Any) -> None:
    assert ours.tokenizer is not None
    assert ours.tokenizer.chat_template == hf_tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.tokenizer.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
