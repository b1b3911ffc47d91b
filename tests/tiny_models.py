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
               "qwen2": transformers.Qwen2Config}
    cls = configs[family]
    cfg = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=(family == "qwen2"),
    )
    if family == "mistral":
        cfg["sliding_window"] = None
    if family == "llama":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    cfg.update(overrides)
    return cls(**cfg)


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
