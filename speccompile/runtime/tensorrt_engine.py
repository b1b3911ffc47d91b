"""TensorRT backend: the engine interface of `core/engine.py` over the bundle's TensorRT engines.

Engines are deserialized after loading the SpecAccept plugin library. Device memory and streams come
from Polygraphy's CUDA wrapper (no torch). Each layer's KV cache is one device buffer whose address is
set for both `past_*` and `present_*`, so TensorScatter updates it in place, as on ONNX Runtime; a
rollback is a smaller `past_len`. Only small outputs (tokens, lengths, probabilities) are copied back.

This module has not been executed on a machine with TensorRT yet (see docs/internals.md: TensorRT engines and plugins).
"""

import numpy as np

from speccompile.bundle import Bundle, GraphId, kv_cache_shape, output_array
from speccompile.errors import SpecCompileError
from speccompile.runtime.model import CachedModel

PREFILL_PROFILE, DECODE_PROFILE = 0, 1  # forward engines: tokens 1..max_seq, tokens 1..2


class TrtModel(CachedModel):
    """Engines and KV cache of one model of a bundle (the bookkeeping is CachedModel's)."""

    def __init__(self, bundle: Bundle, role: str, plugin=None):
        from speccompile.tensorrt_setup import plugin_library, require_tensorrt

        if bundle.model("target").eagle_aux_layers:  # _run binds GRAPH_OUTPUTS only: no features, no head's graphs
            raise SpecCompileError(f"{bundle.path} is built for an EAGLE-3 head (its target outputs features), which "
                                   "the TensorRT backend does not run yet: load it with backend='onnxruntime'")

        trt = require_tensorrt()
        from polygraphy import cuda

        if not bundle.has_engines:
            raise SpecCompileError(f"{bundle.path}: no TensorRT engines in this bundle (build with --backend tensorrt)")
        trt.get_plugin_registry().load_library(str(plugin_library(plugin)))
        super().__init__(bundle, role)
        self._trt, self._cuda = trt, cuda
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.stream = cuda.Stream()
        self._contexts: dict = {}
        self.cache: list = []

    def _allocate(self, slots: int) -> None:
        shape = tuple(kv_cache_shape(self.kv_heads, self.head_dim, self.max_seq, slots))
        self.cache = [self._cuda.DeviceArray(shape=shape, dtype=np.float32) for _ in range(2 * self.num_layers)]
        for buffer in self.cache:
            buffer.copy_from(np.zeros(shape, dtype=np.float32), self.stream)

    def _slot_bytes(self) -> int:
        return self.kv_heads * self.max_seq * self.head_dim * 4

    def _copy_slot(self, source: int, destination: int, length: int) -> None:
        """The whole slot, one contiguous copy per buffer (positions of a slot are strided by head)."""
        size = self._slot_bytes()
        for buffer in self.cache:
            self._cuda.wrapper().memcpy(buffer.ptr + destination * size, buffer.ptr + source * size, size,
                                        self._cuda.MemcpyKind.DeviceToDevice, self.stream.ptr)
        self.stream.synchronize()

    def _move_positions(self, slot: int, sources: np.ndarray, destinations: np.ndarray) -> None:
        """One entry of one head per copy: a slot's positions are strided by head."""
        entry, slot_offset = self.head_dim * 4, slot * self._slot_bytes()
        for buffer in self.cache:
            for head in range(self.kv_heads):
                base = buffer.ptr + slot_offset + head * self.max_seq * entry
                for source, destination in zip(sources, destinations):
                    self._cuda.wrapper().memcpy(base + int(destination) * entry, base + int(source) * entry, entry,
                                                self._cuda.MemcpyKind.DeviceToDevice, self.stream.ptr)
        self.stream.synchronize()

    # -- execution ----------------------------------------------------------------------------
    def load_graphs(self, graphs: list[GraphId], batch: int | None = None) -> None:
        """Deserialize these engines now, so that no generation times an engine load."""
        for graph in graphs:
            self._context(graph.name)

    def _context(self, graph: str):
        if graph not in self._contexts:
            entry = self.bundle.manifest.engines.get(graph)
            if entry is None:
                raise SpecCompileError(f"no TensorRT engine for graph {graph} in this bundle")
            engine = self._runtime.deserialize_cuda_engine((self.bundle.path / entry.file).read_bytes())
            if engine is None:
                raise SpecCompileError(f"TensorRT could not deserialize {entry.file} (built for {entry.gpu}, "
                                       f"TensorRT {entry.tensorrt_version})")
            self._contexts[graph] = (engine, engine.create_execution_context(), {})
        return self._contexts[graph]

    def _run(self, graph: GraphId, first: int, **inputs) -> dict[str, np.ndarray]:
        engine, context, scratch = self._context(graph.name)
        batch = len(inputs["input_ids"])
        if not graph.verifies:
            profile = PREFILL_PROFILE if inputs["input_ids"].shape[1] > 2 else DECODE_PROFILE
            context.set_optimization_profile_async(profile, self.stream.ptr)
        for i in range(self.num_layers):
            for k, kind_name in enumerate(("key", "value")):
                # slots first..first+batch-1 of the cache: slots are its outermost axis, so contiguous
                address = self.cache[2 * i + k].ptr + first * self._slot_bytes()
                shape = tuple(kv_cache_shape(self.kv_heads, self.head_dim, self.max_seq, batch))
                context.set_input_shape(f"past_{kind_name}.{i}", shape)
                context.set_tensor_address(f"past_{kind_name}.{i}", address)
                context.set_tensor_address(f"present_{kind_name}.{i}", address)  # in place
        for name, value in inputs.items():
            host = np.ascontiguousarray(value)
            device = self._scratch(scratch, name, host.shape, host.dtype)
            device.copy_from(host, self.stream)
            context.set_input_shape(name, host.shape)
            context.set_tensor_address(name, device.ptr)
        outputs = {}
        for name in graph.outputs:
            width = inputs["input_ids"].shape[1]
            shape, dtype = output_array(name, batch, self.vocab_size, width,
                                        positions=width if graph.positions_scored == "all" else 1)
            outputs[name] = self._scratch(scratch, name, shape, dtype)
            context.set_tensor_address(name, outputs[name].ptr)
        if not context.execute_async_v3(self.stream.ptr):
            raise SpecCompileError(f"TensorRT failed to execute {graph.name}")
        result = {name: buffer.copy_to(np.empty(buffer.shape, dtype=buffer.dtype), self.stream)
                  for name, buffer in outputs.items()}
        self.stream.synchronize()
        return result

    def _scratch(self, scratch: dict, name: str, shape, dtype):
        """A device buffer per tensor name, grown when a larger shape comes."""
        buffer = scratch.get(name)
        if buffer is None or buffer.dtype != dtype or np.prod(buffer.shape) < np.prod(shape):
            buffer = self._cuda.DeviceArray(shape=tuple(shape), dtype=dtype)
            scratch[name] = buffer
        buffer.resize(tuple(shape))
        return buffer
