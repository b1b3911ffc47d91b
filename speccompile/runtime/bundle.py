"""A bundle on disk: manifest.json + ONNX graphs + weights + tokenizer, integrity-checked on open."""

import hashlib
from dataclasses import dataclass
from pathlib import Path

from speccompile.errors import SpecCompileError, read_json_object

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class Bundle:
    path: Path
    manifest: dict

    @property
    def gammas(self) -> list[int]:
        return list(self.manifest["gammas"])

    def graph(self, name: str) -> dict:
        return self.manifest["graphs"][name]

    def graph_path(self, name: str) -> Path:
        return self.path / self.graph(name)["file"]

    def model(self, role: str) -> dict:
        return self.manifest["models"][role]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_bundle(path, verify: bool = True) -> Bundle:
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise SpecCompileError(f"{path}: not a speccompile bundle (no {MANIFEST})")
    manifest = read_json_object(manifest_file)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise SpecCompileError(
            f"{path}: bundle format version {version!r} is not supported (this speccompile reads version {FORMAT_VERSION}); rebuild the bundle"
        )
    if verify:
        _verify_files(path, manifest["files"])
    return Bundle(path, manifest)


def _verify_files(path: Path, files: dict[str, str]) -> None:
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise SpecCompileError(f"{path}: bundle file {name} is missing")
        if sha256_file(file) != expected:
            raise SpecCompileError(f"{path}: bundle file {name} does not match its sha256 in {MANIFEST} (corrupt or modified)")
