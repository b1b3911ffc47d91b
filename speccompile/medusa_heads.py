"""The Medusa heads format, which `speccompile distill --medusa K` writes and the compiler reads.

Head k (k = 0..K-1) sits on the target's final, normalised hidden state h (the tensor its LM head
multiplies) and predicts the token k + 2 places ahead of the one h was computed at:

    h' = h + SiLU(h @ W_k^T + b_k),    logits_k = lm_head(h')

with the target's own LM head, so only W_k [H, H] and b_k [H] are stored:

    medusa_heads.safetensors   medusa.{k}.weight, medusa.{k}.bias   float16
    medusa_config.json         format, version, num_heads, hidden_size, vocab_size, target_model_type,
                               lm_head ("target"), top_k_accuracy, options, training

numpy + safetensors only: the compiler reads it without torch.
"""

import json
import os
from pathlib import Path

import numpy as np

from speccompile.errors import SpecCompileError, read_json_object

FORMAT, VERSION = "speccompile-medusa", 1
WEIGHTS, CONFIG = "medusa_heads.safetensors", "medusa_config.json"


def write_medusa_heads(out_dir, config: dict, heads: list[tuple[np.ndarray, np.ndarray]]) -> Path:
    """Write `heads` [(W [H, H], b [H])] as float16 and `config` (vocab_size, target_model_type and
    whatever else it holds) under the format's own fields, each file atomically."""
    from safetensors.numpy import save

    out_dir = Path(out_dir)
    hidden = heads[0][0].shape[0]
    for k, (w, b) in enumerate(heads):
        assert w.shape == (hidden, hidden) and b.shape == (hidden,), f"head {k}: {w.shape}, {b.shape}, H = {hidden}"
    tensors = {}
    for k, (w, b) in enumerate(heads):
        tensors[f"medusa.{k}.weight"] = np.ascontiguousarray(w, dtype=np.float16)
        tensors[f"medusa.{k}.bias"] = np.ascontiguousarray(b, dtype=np.float16)
    full = {"format": FORMAT, "version": VERSION, "num_heads": len(heads), "hidden_size": hidden, "lm_head": "target",
            **config}
    (out_dir / (WEIGHTS + ".tmp")).write_bytes(save(tensors))  # save_file would make it readable by its owner only
    os.replace(out_dir / (WEIGHTS + ".tmp"), out_dir / WEIGHTS)
    (out_dir / (CONFIG + ".tmp")).write_text(json.dumps(full, indent=1))
    os.replace(out_dir / (CONFIG + ".tmp"), out_dir / CONFIG)
    return out_dir


def load_medusa_heads(path) -> tuple[dict, list[tuple[np.ndarray, np.ndarray]]]:
    """(config, [(W [H, H], b [H]) as float32 for k = 0..K-1]), or a SpecCompileError saying what is wrong."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise SpecCompileError(f"{path}: not a Medusa heads directory (expected {CONFIG} and {WEIGHTS})")
    config = read_json_object(path / CONFIG)
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise SpecCompileError(f"{path / CONFIG}: format {config.get('format')!r} version {config.get('version')!r}, "
                               f"expected {FORMAT!r} version {VERSION}")
    tensors = _read_tensors(path / WEIGHTS)
    k, hidden = config.get("num_heads"), config.get("hidden_size")
    expected = {f"medusa.{i}.{part}": (hidden, hidden) if part == "weight" else (hidden,)
                for i in range(k if isinstance(k, int) else 0) for part in ("weight", "bias")}
    found = {name: tuple(t.shape) for name, t in tensors.items()}
    if not expected or found != expected:
        wrong = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise SpecCompileError(f"{path / WEIGHTS} does not hold the {k} heads of hidden size {hidden} that {CONFIG} "
                               f"names (first mismatch: {wrong[0] if wrong else 'no heads'})")
    heads = [(tensors[f"medusa.{i}.weight"].astype(np.float32), tensors[f"medusa.{i}.bias"].astype(np.float32))
             for i in range(k)]
    return config, heads


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SpecCompileError(f"{path}: unreadable safetensors file ({e})") from None
