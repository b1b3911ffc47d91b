"""The committed demo pair: loads in HF transformers and speccompile, writes Python, stays small."""

import ast

import pytest
import torch
import transformers

import speccompile
from speccompile.demo import DEMO_DRAFT, DEMO_ROOT, DEMO_TARGET

MAX_SHIPPED_MB = 70  # the pair (50 MB), its Medusa heads (2 MB) and its EAGLE-3 head (17 MB, fp16)


def test_the_pair_is_shipped_small():
    size = sum(p.stat().st_size for p in DEMO_ROOT.rglob("*") if p.is_file()) / 1e6
    assert size <= MAX_SHIPPED_MB, f"{size:.1f} MB"
    assert (DEMO_ROOT / "MODEL_CARD.md").is_file()


def test_the_pair_loads_in_transformers_and_shares_the_tokenizer():
    target = transformers.AutoModelForCausalLM.from_pretrained(DEMO_TARGET)
    draft = transformers.AutoModelForCausalLM.from_pretrained(DEMO_DRAFT)
    assert target.config.model_type == draft.config.model_type == "llama"
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert n_target >= 20e6 and n_draft * 5 < n_target
    tokenizers = [transformers.AutoTokenizer.from_pretrained(d) for d in (DEMO_TARGET, DEMO_DRAFT)]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()


def looks_like_python(text: str) -> bool:
    """Most complete lines parse as Python statements (or are blank/continuations)."""
    lines = [line for line in text.splitlines()[:-1] if line.strip()]
    parsed = 0
    for line in lines:
        stripped = line.strip().rstrip(":")
        try:
            ast.parse(stripped if not line.rstrip().endswith(":") else stripped + ": pass")
            parsed += 1
        except SyntaxError:
            pass
    return len(lines) >= 3 and parsed / len(lines) >= 0.5


@pytest.fixture(scope="module")
def demo_runtime(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECCOMPILE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield speccompile.load()


def test_the_target_writes_python_and_speculation_is_lossless(demo_runtime):
    prompt = "def parse_args(argv):\n"
    [spec] = demo_runtime.generate([prompt], max_new_tokens=48, gamma=4)
    [base] = demo_runtime.generate([prompt], max_new_tokens=48, mode="autoregressive")
    assert spec.token_ids == base.token_ids
    assert looks_like_python(prompt + spec.text), spec.text
    assert spec.stats.acceptance_rate > 0.5


def test_speccompile_matches_transformers_on_the_demo_target(demo_runtime):
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    ids = demo_runtime.tokenizer.encode("import os\n")
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=24, do_sample=False, pad_token_id=1)[0, len(ids):].tolist()
    [result] = demo_runtime.generate([ids], max_new_tokens=24)
    assert result.token_ids == expected[: len(result.token_ids)]
