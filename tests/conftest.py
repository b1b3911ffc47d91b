import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def saved_graphs_cache(tmp_path_factory):
    """Session graphs optimized by the tests are saved in a directory of the test run, not in the
    user's cache (runtime/saved_graphs.py)."""
    from speccompile.runtime import saved_graphs

    root = tmp_path_factory.mktemp("optimized")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(saved_graphs, "saved_graphs_root", lambda: root)
        yield root


@pytest.fixture(scope="session", autouse=True)
def no_shared_thread_pool():
    """The CLI asks for ONNX Runtime's process-wide thread pool (onnxruntime_engine.shared_thread_pool).
    Inside the test process it would bind every later test's own sessions, so it is switched off
    here; tests/runtime/test_threads.py tests it in subprocesses."""
    import os

    os.environ["SPECCOMPILE_SHARED_THREADS"] = "0"
    from speccompile.runtime.onnxruntime_engine import shared_thread_pool

    assert not shared_thread_pool(create=True)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt2"]


@pytest.fixture(scope="session")
def tokenizer():
    from tests.tiny_models import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tokenizer):
    """checkpoints(family, role) -> path of a cached tiny random checkpoint.

    role "target": the target; "draft": an unrelated, smaller random model of the same family.
    """
    from tests.tiny_models import make_checkpoint

    made = {}

    def get(family: str, role: str = "target"):
        if (family, role) not in made:
            path = tmp_path_factory.mktemp(f"{family}-{role}")
            seed, size = (0, "target") if role == "target" else (1, "draft")
            made[family, role] = make_checkpoint(path / "ckpt", family, seed=seed, size=size, tokenizer=tokenizer)
        return made[family, role]

    return get


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, checkpoints):
    """bundles(family, draft, draft_weights, backend) -> path of a built bundle; draft is "copy" (the
    target itself), "random" or "none" (a draft-free bundle); draft_weights as `speccompile build
    --draft-weights` (default: float32 for the copy, so that it agrees with the target exactly; int8,
    the build's default, for random); backend as `--backend` ("onnx": portable graphs)."""
    from speccompile.compiler.build import build_bundle

    made = {}

    def get(family: str, draft: str = "copy", draft_weights: str | None = None, backend: str = "onnxruntime"):
        draft_weights = draft_weights or ("float32" if draft == "copy" else "int8")
        key = family, draft, draft_weights, backend
        if key not in made:
            target = checkpoints(family, "target")
            draft_dir = {"copy": target, "none": None, "medusa": None}[draft] if draft != "random" \
                else checkpoints(family, "draft")
            out = tmp_path_factory.mktemp(f"bundle-{family}-{draft}-{draft_weights}-{backend}") / "bundle"
            medusa = random_medusa_heads(target, out.parent / "heads") if draft == "medusa" else None
            made[key] = build_bundle(target, draft_dir, out, gammas=[1, 4], max_seq=96, max_batch=4,
                                     draft_weights=draft_weights, medusa_dir=medusa, backend=backend)
        return made[key]

    return get


MEDUSA_HEADS = 3


def random_medusa_heads(target_dir, out_dir, heads: int = MEDUSA_HEADS, seed: int = 0):
    """Medusa heads of random weights for a checkpoint (exactness does not depend on what they
    propose), with made-up accuracies that grow a branching tree."""
    import json

    from speccompile.medusa_heads import write_medusa_heads

    config = json.loads((target_dir / "config.json").read_text())
    hidden = config.get("hidden_size", config.get("n_embd"))
    rng = np.random.default_rng(seed)
    weights = [(rng.normal(0, 0.3, (hidden, hidden)), rng.normal(0, 0.3, hidden)) for _ in range(heads)]
    accuracy = [[0.5 * 0.6**c / (k + 1) for c in range(10)] for k in range(heads)]
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_medusa_heads(out_dir, {"vocab_size": config["vocab_size"], "target_model_type": config["model_type"],
                                        "top_k_accuracy": accuracy}, weights)
