"""Random-weight Hugging Face Llama checkpoints with the shapes of real models, for memory and speed checks.

    python tools/make_random_checkpoint.py --shape tinyllama-1.1b --out /tmp/tl11
    python tools/make_random_checkpoint.py --draft-of /tmp/tl11 --layers 2 --out /tmp/tl11-draft

No weights can be downloaded here, so real-size checks run on random weights with real shapes:
what memory and step time depend on. Shards are written tensor by tensor in the safetensors format
(fp16 by default, as real checkpoints ship), so making an 8B checkpoint needs no more memory than
its largest tensor. The tokenizer is the demo target's (8192 tokens; the model's embedding rows
beyond it are padding, as in real checkpoints).

`--draft-of TARGET --layers N` makes a draft that shares the target's embeddings, final norm, LM
head and first N blocks (the layer-skip kind of draft). With plain random weights it rarely agrees
with its target; `--residual-scale` below 1 (e.g. 0.1) shrinks what each block adds to the residual
stream, so the embedding dominates and the draft agrees often enough to make speculative decoding
measurable at real shapes. Its acceptance says nothing about real models and is reported, not
assumed.
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from speccompile.compiler.tensors import safetensors_tensors

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, max positions, tied embeddings
    "tinyllama-1.1b": (2048, 5632, 22, 32, 4, 32000, 2048, False),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, 32768, True),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, 131072, True),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256, 8192, False),
    "small-322m": (1024, 2816, 20, 16, 8, 8192, 2048, False),
}
# what a shape's config says beyond the shapes: Llama 3.x's RoPE scaling, as in its released configs
CONFIG_EXTRAS = {
    "llama-3.2-1b": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-3-8b": {"rope_theta": 500000.0},
    "qwen2.5-0.5b": {"rope_theta": 1000000.0},
}
DTYPES = {"float16": ("F16", np.float16), "float32": ("F32", np.float32)}
SHARD_BYTES = 2 << 30
DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "speccompile" / "demo" / "target"


def llama_config(hidden, intermediate, layers, heads, kv_heads, vocab, max_positions, tied) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": max_positions,
        "tie_word_embeddings": tied, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1, "torch_dtype": "float16",
    }


def tensor_shapes(config: dict) -> dict[str, tuple]:
    h, i, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"]
    d = h // config["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return shapes


def random_tensor(name: str, shape: tuple, rng, residual_scale: float = 1.0) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    std = 0.02 * (residual_scale if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def write_checkpoint(out: Path, config: dict, tensors, dtype: str, log=print) -> None:
    """tensors: (name, shape, make) in order; each made, written and dropped in turn."""
    code, np_dtype = DTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    for name, shape, make in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, make))
        size += nbytes
    shards.append(current)
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
             for k in range(len(shards))]
    for file, shard in zip(names, shards):
        _write_shard(out / file, shard, code, np_dtype, log)
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name, _, _ in shard}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (DEMO_TOKENIZER / file).is_file():
            shutil.copy(DEMO_TOKENIZER / file, out / file)


def _write_shard(path: Path, shard, code: str, np_dtype, log) -> None:
    header, offset = {}, 0
    for name, shape, _ in shard:
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for _, _, make in shard:
            np.ascontiguousarray(make(), dtype=np_dtype).tofile(f)
    log(f"  {path.name}: {len(shard)} tensors")


def random_checkpoint(shape: str, out: Path, dtype: str, seed: int, residual_scale: float = 1.0) -> None:
    config = llama_config(*SHAPES[shape]) | CONFIG_EXTRAS.get(shape, {})
    rng = np.random.default_rng(seed)
    tensors = [(name, s, lambda name=name, s=s: random_tensor(name, s, rng, residual_scale))
               for name, s in tensor_shapes(config).items()]
    write_checkpoint(out, config, tensors, dtype)


def layer_skip_draft(target: Path, layers: int, out: Path, dtype: str) -> None:
    """The target's embeddings, final norm, LM head and first `layers` blocks."""
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    source = {}
    for file in sorted(target.glob("*.safetensors")):
        source.update(safetensors_tensors(file))
    tensors = [(name, s, source[name].load) for name, s in tensor_shapes(config).items()]
    write_checkpoint(out, config, tensors, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--draft-of", type=Path, help="make a layer-skip draft of this checkpoint instead")
    parser.add_argument("--layers", type=int, default=2, help="blocks the draft keeps (with --draft-of)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--residual-scale", type=float, default=1.0,
                        help="scale of the blocks' output projections (o_proj, down_proj): below 1, each block "
                             "moves the residual stream less, and a layer-skip draft agrees with the target more")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if (args.shape is None) == (args.draft_of is None):
        parser.error("give exactly one of --shape and --draft-of")
    if args.draft_of:
        layer_skip_draft(args.draft_of, args.layers, args.out, args.dtype)
    else:
        random_checkpoint(args.shape, args.out, args.dtype, args.seed, args.residual_scale)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
