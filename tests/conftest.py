import pytest

FAMILIES = ["llama", "mistral", "qwen2", "gpt2"]


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
    """bundles(family, draft) -> path of a built bundle; draft is "copy" (the target itself) or "random"."""
    from speccompile.compiler.build import build_bundle

    made = {}

    def get(family: str, draft: str = "copy"):
        if (family, draft) not in made:
            target = checkpoints(family, "target")
            draft_dir = target if draft == "copy" else checkpoints(family, "draft")
            out = tmp_path_factory.mktemp(f"bundle-{family}-{draft}") / "bundle"
            made[family, draft] = build_bundle(target, draft_dir, out, gammas=[1, 4], max_seq=96, max_batch=4, log=lambda _: None)
        return made[family, draft]

    return get
