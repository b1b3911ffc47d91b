"""Write a tiny random target/draft pair of HF checkpoints (a stand-in until a trained pair is given).

    python -m tools.make_tiny_pair OUT_DIR [--family llama]

Writes OUT_DIR/target and OUT_DIR/draft (same tokenizer; the draft is smaller and unrelated).
"""

import argparse
from pathlib import Path

from tests.tiny_models import make_checkpoint, make_tokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2", "gpt2"])
    args = parser.parse_args()
    tokenizer = make_tokenizer()
    make_checkpoint(args.out / "target", args.family, seed=0, tokenizer=tokenizer)
    make_checkpoint(args.out / "draft", args.family, seed=1, size="draft", tokenizer=tokenizer)
    print(f"wrote {args.out}/target and {args.out}/draft")


if __name__ == "__main__":
    main()
