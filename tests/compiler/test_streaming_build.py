"""The build's memory is bounded by its largest tensor, not by the model (compiler/tensors.py)."""

import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from speccompile.compiler.build import build_bundle
from speccompile.compiler.tensors import safetensors_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import make_random_checkpoint as random_checkpoints

# 32 thin blocks: many tensors, none large; 8192-token vocabulary (the demo tokenizer's)
SHAPE = {"hidden": 256, "intermediate": 704, "layers": 32, "heads": 4, "kv_heads": 2, "vocab": 8192,
         "max_positions": 512, "tied": False}


def _checkpoint(out: Path) -> Path:
    config = random_checkpoints.llama_config(*SHAPE.values())
    rng = np.random.default_rng(0)
    tensors = [(name, shape, lambda name=name, shape=shape: random_checkpoints.random_tensor(name, shape, rng))
               for name, shape in random_checkpoints.tensor_shapes(config).items()]
    random_checkpoints.write_checkpoint(out, config, tensors, "float16", log=lambda _: None)
    return out


@pytest.mark.slow
def test_build_peak_memory_is_a_few_largest_tensors_not_the_model(tmp_path):
    target = _checkpoint(tmp_path / "target")
    shapes = [t.shape for t in safetensors_tensors(target / "model.safetensors").values()]
    model_bytes = 4 * sum(int(np.prod(s)) for s in shapes)  # as float32
    largest = 4 * max(int(np.prod(s)) for s in shapes)
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        build_bundle(target, target, tmp_path / "bundle", gammas=[2, 4], max_seq=64, max_batch=2,
                     draft_weights="int8")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    weights = sum((tmp_path / "bundle" / f"{role}.weights").stat().st_size for role in ("target", "draft"))
    assert weights > 2 * model_bytes * 0.6  # both models' weights were written (the draft's in int8)
    # one tensor in flight: read (fp16), converted, transposed, quantized; never the model
    assert peak < 6 * largest + (8 << 20), f"peak {peak / 1e6:.1f} MB; largest tensor {largest / 1e6:.1f} MB"
    assert peak < model_bytes / 2, f"peak {peak / 1e6:.1f} MB for a model of {model_bytes / 1e6:.1f} MB"
