"""A hardware fingerprint: what a γ profile was measured on, to match it against this machine."""

import hashlib
import json
import os
import platform

from speccompile.tensorrt_setup import gpu

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_int8", "asimd", "sve")


def _cpuinfo() -> dict[str, str]:
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def fingerprint(backend: str = "onnxruntime", providers=("CPUExecutionProvider",)) -> dict:
    cpu = _cpuinfo()
    flags = set((cpu.get("flags") or cpu.get("Features") or "").split())
    result = {
        "machine": platform.machine(),
        "cpu": cpu.get("model name") or platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "isa": sorted(flags & set(ISA_FLAGS)),
        "backend": backend,
        "providers": list(providers),
    }
    if backend == "onnxruntime":
        import onnxruntime

        result["backend_version"] = onnxruntime.__version__
    elif backend == "tensorrt":  # engines are per GPU: the GPU, not the CPU, decides the timings
        import tensorrt

        result["backend_version"] = tensorrt.__version__
        result.update(gpu())
    return result


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
