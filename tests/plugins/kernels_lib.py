"""Build the speccompile CUDA kernels with nvcc and call their C ABI from Python (ctypes).

Device memory comes from torch when it has CUDA, else from libcudart through ctypes, so the kernels
can be checked on a GPU machine with or without a CUDA build of torch.
"""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
KERNELS_CU = PLUGINS / "kernels" / "spec_accept_kernels.cu"
SYMBOLS = ("speccompile_greedy_accept", "speccompile_sample_accept", "speccompile_sample", "speccompile_transform",
           "speccompile_tree_accept", "speccompile_tree_typical_accept")
MAX_TREE_NODES = 1024  # SPECCOMPILE_MAX_TREE_NODES in spec_accept_kernels.h

P, N, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p  # device pointer, int, cudaStream_t
SIGNATURES = {
    "speccompile_greedy_accept": [P, P, P, P, N, N, N, P, P, P, S],
    "speccompile_sample_accept": [P, P, P, P, P, P, P, N, N, N, P, P, P, S],
    "speccompile_sample": [P, P, N, N, P, S],
    "speccompile_transform": [P, P, P, P, N, N, N, P, S],
    "speccompile_tree_accept": [P, P, P, P, P, P, N, N, N, P, P, P, P, S],
    "speccompile_tree_typical_accept": [P, P, P, P, P, P, P, P, N, N, N, P, P, P, P, S],
}

# ---- build -------------------------------------------------------------------------------------


def compile_kernels(out: Path, arch: str) -> Path:
    """nvcc the kernels into a shared library for one architecture (e.g. sm_80)."""
    cmd = ["nvcc", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch}", "-o", str(out), str(KERNELS_CU)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return out


def exported_symbols(library: Path) -> set[str]:
    """Names of the defined dynamic symbols of a shared library (`nm -D`)."""
    proc = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}


def load_kernels(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


# ---- CUDA runtime via ctypes -----------------------------------------------------------------------


def load_cudart() -> ctypes.CDLL | None:
    """libcudart from the loader path or next to nvcc; None when there is none."""
    candidates = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    nvcc = shutil.which("nvcc")
    for root in ([Path(nvcc).resolve().parents[1]] if nvcc else []) + [Path("/usr/local/cuda")]:
        candidates += [str(root / "lib64" / "libcudart.so"), str(root / "lib" / "libcudart.so")]
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def torch_cuda():
    """The torch module when it is importable and sees a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def no_cuda_device_reason() -> str | None:
    """None when a CUDA device is visible, else why not (cheap: tries libcudart before torch)."""
    cudart = load_cudart()
    if cudart is not None:
        count = ctypes.c_int(0)
        err = cudart.cudaGetDeviceCount(ctypes.byref(count))
        if err == 0 and count.value > 0:
            return None
        why = f"cudaGetDeviceCount returned error {err}, {count.value} devices"
    else:
        why = "libcudart could not be loaded"
    if torch_cuda() is not None:
        return None
    return f"no CUDA device visible ({why}; torch.cuda.is_available() is not True)"


def device_arch() -> str:
    """sm_XY of device 0."""
    torch = torch_cuda()
    if torch is not None:
        major, minor = torch.cuda.get_device_capability(0)
        return f"sm_{major}{minor}"
    cudart, major, minor = load_cudart(), ctypes.c_int(), ctypes.c_int()
    assert cudart.cudaDeviceGetAttribute(ctypes.byref(major), 75, 0) == 0  # cudaDevAttrComputeCapabilityMajor
    assert cudart.cudaDeviceGetAttribute(ctypes.byref(minor), 76, 0) == 0  # cudaDevAttrComputeCapabilityMinor
    return f"sm_{major.value}{minor.value}"


# ---- device buffers ---------------------------------------------------------------------------------


class TorchDevice:
    """Device buffers as torch CUDA tensors; kernels run on torch's current stream."""

    def __init__(self, torch):
        self.torch, self.tensors = torch, {}
        self.stream = torch.cuda.current_stream().cuda_stream

    def put(self, array: np.ndarray) -> int:
        tensor = self.torch.from_numpy(np.ascontiguousarray(array)).cuda()
        self.tensors[tensor.data_ptr()] = tensor
        return tensor.data_ptr()

    def get(self, ptr: int) -> np.ndarray:
        self.torch.cuda.synchronize()
        return self.tensors[ptr].cpu().numpy()

    def free(self):
        self.tensors.clear()


class CudartDevice:
    """Device buffers from cudaMalloc; kernels run on the legacy default stream."""

    H2D, D2H = 1, 2  # cudaMemcpyKind

    def __init__(self, cudart: ctypes.CDLL):
        self.cudart, self.buffers, self.stream = cudart, {}, None

    def put(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        ptr = ctypes.c_void_p()
        assert self.cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(max(array.nbytes, 1))) == 0
        source = array.ctypes.data_as(ctypes.c_void_p)
        copied = self.cudart.cudaMemcpy(ptr, source, ctypes.c_size_t(array.nbytes), self.H2D)
        assert copied == 0
        self.buffers[ptr.value] = (array.shape, array.dtype)
        return ptr.value

    def get(self, ptr: int) -> np.ndarray:
        assert self.cudart.cudaDeviceSynchronize() == 0
        shape, dtype = self.buffers[ptr]
        out = np.empty(shape, dtype)
        destination = out.ctypes.data_as(ctypes.c_void_p)
        copied = self.cudart.cudaMemcpy(destination, ctypes.c_void_p(ptr), ctypes.c_size_t(out.nbytes), self.D2H)
        assert copied == 0
        return out

    def free(self):
        for ptr in self.buffers:
            self.cudart.cudaFree(ctypes.c_void_p(ptr))
        self.buffers.clear()


def open_device():
    torch = torch_cuda()
    return TorchDevice(torch) if torch is not None else CudartDevice(load_cudart())


# ---- the kernels, numpy in, numpy out -------------------------------------------------------------------


def _outputs(device, batch: int, count: int) -> list[int]:
    return [device.put(np.zeros(batch, np.int64)) for _ in range(count)]


def greedy_accept(lib, device, logits, draft_tokens, draft_len, past_len):
    batch, positions, vocab = logits.shape
    outs = _outputs(device, batch, 3)
    arrays = [(logits, np.float32), (draft_tokens, np.int64), (draft_len, np.int64), (past_len, np.int64)]
    ins = [device.put(np.asarray(a, dt)) for a, dt in arrays]
    assert lib.speccompile_greedy_accept(*ins, batch, positions - 1, vocab, *outs, device.stream) == 0
    return tuple(device.get(p) for p in outs)


def sample_accept(lib, device, target_probs, draft_probs, draft_tokens, draft_len, u_accept, u_sample, past_len):
    batch, positions, vocab = target_probs.shape
    outs = _outputs(device, batch, 3)
    arrays = [(target_probs, np.float32), (draft_probs, np.float32), (draft_tokens, np.int64), (draft_len, np.int64),
              (u_accept, np.float32), (u_sample, np.float32), (past_len, np.int64)]
    ins = [device.put(np.asarray(a, dt)) for a, dt in arrays]
    assert lib.speccompile_sample_accept(*ins, batch, positions - 1, vocab, *outs, device.stream) == 0
    return tuple(device.get(p) for p in outs)


def sample(lib, device, probs, uniform):
    batch, vocab = probs.shape
    [out] = _outputs(device, batch, 1)
    ins = [device.put(np.asarray(probs, np.float32)), device.put(np.asarray(uniform, np.float32))]
    assert lib.speccompile_sample(*ins, batch, vocab, out, device.stream) == 0
    return device.get(out)


def transform(lib, device, logits, temperature, top_k, top_p, in_place=False):
    """probs [B, R, V] for logits [B, R, V] and per-batch temperature, top_k, top_p; with in_place the
    kernel overwrites the logits buffer."""
    batch, rows, vocab = logits.shape
    x = device.put(np.asarray(logits, np.float32))
    out = x if in_place else device.put(np.zeros((batch, rows, vocab), np.float32))
    params = [device.put(np.asarray(a, dt))
              for a, dt in [(temperature, np.float32), (top_k, np.int64), (top_p, np.float32)]]
    assert lib.speccompile_transform(x, *params, batch, rows, vocab, out, device.stream) == 0
    return device.get(out)


def _tree_accept(fn, device, logits, arrays):
    """(accepted, next_token, new_len, best_node) of a tree kernel on logits [B, N, V] and its other inputs."""
    batch, nodes, vocab = logits.shape
    outs = _outputs(device, batch, 4)
    ins = [device.put(np.asarray(a, dt)) for a, dt in [(logits, np.float32), *arrays]]
    assert fn(*ins, batch, nodes, vocab, *outs, device.stream) == 0
    return tuple(device.get(p) for p in outs)


def tree_accept(lib, device, logits, tree_tokens, draft_len, past_len, parents, depths):
    arrays = [(a, np.int64) for a in (tree_tokens, draft_len, past_len, parents, depths)]
    return _tree_accept(lib.speccompile_tree_accept, device, logits, arrays)


def tree_typical_accept(lib, device, logits, tree_tokens, draft_len, past_len, parents, depths, epsilon, delta):
    arrays = [(a, np.int64) for a in (tree_tokens, draft_len, past_len, parents, depths)]
    arrays += [(epsilon, np.float32), (delta, np.float32)]
    return _tree_accept(lib.speccompile_tree_typical_accept, device, logits, arrays)
