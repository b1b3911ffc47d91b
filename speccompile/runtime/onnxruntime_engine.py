"""ONNX Runtime backend: one `OrtModel` per model (target or draft), implementing the engine interface.

The KV cache of each layer is one OrtValue bound as both `past_*` input and `present_*` output of
every graph, so TensorScatter writes new entries into it in place: no step copies the cache, and a
rollback is only a smaller `past_len` on the next call.
"""

import numpy as np

from speccompile.errors import SpecCompileError
from speccompile.runtime.bundle import Bundle


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise SpecCompileError("the ONNX Runtime backend needs onnxruntime: pip install onnxruntime") from None
    return onnxruntime


def session_options(threads: int | None = None):
    ort = _ort()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    return options


class OrtModel:
    """Sessions, KV cache and per-sequence cache lengths of one model of a bundle."""

    def __init__(self, bundle: Bundle, role: str, providers=("CPUExecutionProvider",), threads: int | None = None):
        ort = _ort()
        info = bundle.model(role)
        self.role = role
        self.num_layers, self.kv_heads, self.head_dim = info["num_layers"], info["num_kv_heads"], info["head_dim"]
        self.max_seq, self.vocab_size = bundle.manifest["max_seq"], bundle.manifest["vocab_size"]
        options = session_options(threads)
        providers = list(providers)

        def session(name):
            return ort.InferenceSession(str(bundle.graph_path(name)), options, providers=providers)

        self._forward = session(f"{role}_forward")
        self._verify = {g: session(f"{role}_verify_g{g}") for g in bundle.gammas} if role == "target" else {}
        self._bindings: dict = {}
        self.cache: list = []
        self.cache_lengths = np.zeros(0, dtype=np.int64)

    def compiled_gammas(self) -> list[int]:
        return sorted(self._verify)

    # -- engine interface ---------------------------------------------------------------------
    def start(self, batch_size: int) -> None:
        if len(self.cache_lengths) != batch_size:
            self._allocate(batch_size)
        self.cache_lengths = np.zeros(batch_size, dtype=np.int64)

    def forward(self, tokens: np.ndarray, token_count: np.ndarray) -> np.ndarray:
        binding, outputs = self._bindings["forward"]
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, dtype=np.int64))
        binding.bind_cpu_input("past_len", self.cache_lengths)
        binding.bind_cpu_input("token_count", np.ascontiguousarray(token_count, dtype=np.int64))
        self._forward.run_with_iobinding(binding)
        self.cache_lengths = self.cache_lengths + token_count
        return outputs["next_token"].copy()

    def verify(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        gamma = tokens.shape[1] - 1
        binding, outputs = self._bindings[gamma]
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, dtype=np.int64))
        binding.bind_cpu_input("past_len", self.cache_lengths)
        self._verify[gamma].run_with_iobinding(binding)
        self.cache_lengths = outputs["new_len"].copy()
        return outputs["accepted"].copy(), outputs["next_token"].copy()

    # -- buffers ------------------------------------------------------------------------------
    def _allocate(self, batch: int) -> None:
        ort = _ort()
        shape = (batch, self.kv_heads, self.max_seq, self.head_dim)
        self.cache = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=np.float32)) for _ in range(2 * self.num_layers)]
        self._bindings = {"forward": self._bind(self._forward, batch, ["next_token"])}
        for gamma, session in self._verify.items():
            self._bindings[gamma] = self._bind(session, batch, ["accepted", "next_token", "new_len"])

    def _bind(self, session, batch: int, small_outputs: list[str]):
        """An IOBinding with the cache bound in place and small int64 outputs in reusable arrays."""
        ort = _ort()
        binding = session.io_binding()
        for i in range(self.num_layers):
            for k, kind in enumerate(("key", "value")):
                cache = self.cache[2 * i + k]
                binding.bind_ortvalue_input(f"past_{kind}.{i}", cache)
                binding.bind_ortvalue_output(f"present_{kind}.{i}", cache)
        arrays = {}
        for name in small_outputs:
            arrays[name] = np.zeros(batch, dtype=np.int64)
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(arrays[name]))
        return binding, arrays
