"""Tiny random Hugging Face checkpoints of every supported family, made on the fly.

Every test model is built here from a transformers config and a byte-level BPE tokenizer trained
on a few lines of text, then saved with `save_pretrained` (safetensors), exactly as a user's
checkpoint directory would look.
"""

from pathlib import Path

TEXT = [
    "def parse_args(argv):\n    return argv[1:]\n",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "the quick brown fox jumps over the lazy dog. " * 3,
    "class Model:\n    def __init__(self, n):\n        self.n = n\n",
]
VOCAB = 320
SPECIALS = ["<s>", "</s>", "<pad>"]


def make_tokenizer(vocab_size: int = VOCAB, extra_tokens: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 4, trainer)
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _config(family: str, vocab: int, size: str, **overrides):
    import transformers

    small = size == "draft"
    hidden, layers = (32, 1) if small else (64, 2)
    if family == "gpt2":
        cfg = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, bos_token_id=0,
                   eos_token_id=1)
        cfg.update(overrides)
        return transformers.GPT2Config(**cfg)
    configs = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "gemma3": transformers.Gemma3TextConfig, "phi3": transformers.Phi3Config}
    cls = configs[family]
    cfg = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=family in ("qwen2", "qwen3", "gemma3"),
    )
    cfg.update(FAMILY_CONFIGS[family](hidden, layers) if family in FAMILY_CONFIGS else {})
    cfg.update(overrides)
    return cls(**cfg)


# What each family's tiny models exercise beyond Llama's: odd head sizes (head_dim is not hidden /
# heads), sliding windows shorter than a test's prompt plus output, each family's RoPE variant.
WINDOW = 8
FAMILY_CONFIGS = {
    "llama": lambda hidden, layers: {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
    "mistral": lambda hidden, layers: {"sliding_window": WINDOW},
    "qwen3": lambda hidden, layers: {"head_dim": 48 if hidden == 64 else 16},
    "gemma3": lambda hidden, layers: {
        "head_dim": 48 if hidden == 64 else 16, "query_pre_attn_scalar": 40, "sliding_window": WINDOW,
        # sliding then global, each with its own RoPE: the global one scaled
        "layer_types": ["sliding_attention", "full_attention"][:layers],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0}}},
    "phi3": lambda hidden, layers: _phi3(2 * hidden if hidden == 64 else hidden),
}


def _phi3(hidden: int) -> dict:
    """Phi-4-mini's partial rotary (3/4 of each head) and Phi-3's LongRoPE. The target's heads are of
    64 (two of them, one KV head), so its 48 rotary dimensions fit ONNX Runtime's fused kernel. The
    original length exceeds the tests' caches, so HF and the build both use the short factors."""
    heads = 2 if hidden == 128 else 4
    rotary_pairs = hidden // heads * 3 // 8
    return {"hidden_size": hidden, "intermediate_size": hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads // 2, "sliding_window": None, "original_max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                "short_factor": [1.0 + 0.1 * j for j in range(rotary_pairs)],
                                "long_factor": [2.0 + j for j in range(rotary_pairs)]}}


EMBEDDING_PADDING = 8  # rows beyond the tokenizer, as real checkpoints pad their embeddings


def make_checkpoint(path, family: str, seed: int = 0, size: str = "target", tokenizer=None, init_std: float = 0.2,
                    vocab_size: int | None = None, **overrides) -> Path:
    """Save a random `family` model (+ tokenizer) to `path`; returns the path.

    init_std is large so that logits are well separated: greedy parity tests then compare argmaxes
    that float rounding cannot flip.
    """
    import torch
    import transformers

    path = Path(path)
    tokenizer = tokenizer or make_tokenizer()
    config = _config(family, vocab_size or len(tokenizer) + EMBEDDING_PADDING, size, **overrides)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def copy_checkpoint(src, dst) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return Path(dst)


def make_word_tokenizer(size: int = 16):
    """A word-level tokenizer of `size` tokens with no special tokens at all (so nothing is EOS):
    for tests that enumerate every continuation of a prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)
