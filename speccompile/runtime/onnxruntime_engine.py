"""ONNX Runtime backend: one `OrtModel` per model (target, draft or EAGLE-3 head), implementing the engine
interface.

The KV cache of each layer is one OrtValue bound as both `past_*` input and `present_*` output of
every graph, so TensorScatter writes new entries into it in place: no step copies the cache, and a
rollback is only a smaller `past_len` on the next call. Small outputs (tokens, lengths,
probabilities) land in numpy arrays bound once per batch size; the target's features (aux_hidden,
[B, T, F]) in one bound per call width T, as prompt chunks come.

A batch of one sequence runs each graph's single-sequence variant where the bundle has one: the same
interface and cache, with attention in ONNX Runtime's fused kernel (see compiler/transformer.py).
"""

import os

import numpy as np

from speccompile.bundle import AUX_HIDDEN, HEAD_ROLE, Bundle, GraphId, kv_cache_shape, output_array
from speccompile.errors import SpecCompileError
from speccompile.runtime import saved_graphs
from speccompile.runtime.model import CachedModel


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise SpecCompileError("the ONNX Runtime backend needs onnxruntime: pip install onnxruntime") from None
    return onnxruntime


def shared_thread_pool(threads: int | None = None, create: bool = True) -> bool:
    """Whether this process's ONNX Runtime sessions run on one process-wide intra-op thread pool,
    asking for it first when `create` (unless $SPECCOMPILE_SHARED_THREADS is 0). `threads` sizes it;
    default: ONNX Runtime's, one per physical core. Sessions created before keep their own pools.

    Why it exists: the speculative loop alternates draft steps and verifications on different
    sessions, and pools per session whose threads spin after a run take the cores the other
    session needs next. Pools per session that release their threads at the end of every run
    (session_options, the default) avoid that as well, so this pool is an option, not the fast path.

    Why not the default: the pool is process-wide. Once it exists, every ONNX Runtime session in
    the process must be created without per-session threads, including an application's own.
    """
    _ort()
    from onnxruntime.capi import _pybind_state

    if create and os.environ.get("SPECCOMPILE_SHARED_THREADS", "1") != "0":
        try:
            _pybind_state.set_global_thread_pool_sizes(threads or 0, 1)
        except _pybind_state.Fail as e:  # a second runtime in the process: the pool exists (or cannot now)
            if "already been created" not in str(e):
                raise
    return _process_has_shared_pool()


# A one-node model (Identity, x -> y, float [1], opset 13), serialized: what onnx.helper makes of it,
# kept as bytes so that a load need not import onnx (about 1 s, most of it its ml_dtypes import) to
# ask ONNX Runtime a question. tests/runtime/test_threads.py rebuilds it with onnx and compares.
PROBE_MODEL = (b'\x08\x08:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05probeZ\x0f\n\x01x\x12\n\n\x08\x08\x01'
               b'\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B\x04\n\x00\x10\r')


def _process_has_shared_pool() -> bool:
    """ONNX Runtime refuses a session with its own threads in a process that has the shared pool."""
    from onnxruntime import SessionOptions
    from onnxruntime.capi import _pybind_state

    try:  # the binding's own session class: no provider fallback that would print the error first
        _pybind_state.InferenceSession(SessionOptions(), PROBE_MODEL, False, False)
    except RuntimeError as e:
        if "global thread pool" in str(e):
            return True
        raise
    return False


def session_options(threads: int | None = None, spinning: bool | None = None, shared_pool: bool = False):
    """Options of every session the backend makes. On pools per session (the default), the pool's
    threads spin between the parallel regions of a run, and are released when the run ends
    (`session.force_spinning_stop`): the next run, often the other model's session, finds the
    cores free. Measured on the demo pair (2 cores, held-out completions, 5 pairs of processes
    alternating the settings, medians of the pairs' ratios): speculative decoding at 1.05x the
    shared pool's rate, plain decoding at 0.85x (each step wakes the pool again). Keeping the
    target's step sessions spinning made plain decoding 1.01x and the loop 0.75x; pools that kept
    spinning after every run ran the loop at 0.45x, pools that never spin at about 0.8x.

    Pre-packing runs on the session's threads (`session.prepack.enable_parallel`): on the 1.1B
    targets, 5 fresh processes per setting, interleaved, int4 0.84-0.94 s against 0.86-1.06 s one
    weight at a time, int8 1.83-1.98 against 2.29-2.47 s (docs/performance.md, "Starting")."""
    ort = _ort()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.prepack.enable_parallel", "1")
    if shared_pool:
        options.use_per_session_threads = False
        return options
    if threads:
        options.intra_op_num_threads = threads
    spinning = True if spinning is None else spinning
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


# A target runs on one session graph from this size of weights up (unless asked otherwise). Below it a
# session per graph is faster: the session graph's per-layer If (attention kernel chosen per call)
# costs about 0.1 ms per layer per call on the demo pair (7.0 vs 6.4 ms per target step, 10%),
# while a second copy of small weights costs little. From 256 MiB up a step streams the weights for
# 13 ms or more here, the Ifs cost about 1% (1.1B target: 174-189 vs 172 ms), and every copy saved
# is a model's worth of memory.
ONE_SESSION_MIN_BYTES = 256 << 20


def runs_one_session(bundle: Bundle, role: str, asked: bool | None = None) -> bool:
    """Whether `role` runs every call on its one session graph: as asked, else by its target's weights.
    A draft follows its target, whatever its own size: beside a real-size target its sampled and
    batched graphs would otherwise open (and pre-pack its weights again) inside the first sampled or
    batched request, as a real-size target's warm-up is skipped (1.1B int4 pair, 2-layer draft of
    155 MB: that request 0.12-0.3 s slower than the next; on its session graph none is, a draft step
    took 5.2 against 5.6 ms, and it opened in the same 0.14-0.21 s)."""
    info = bundle.model(role)
    if info.session is None:
        if asked:
            raise SpecCompileError(f"{bundle.path}: this bundle has no session graphs "
                                   "(rebuild it to run one session per model)")
        return False
    if asked is not None:
        return asked
    return (bundle.path / bundle.model("target").weights_file).stat().st_size >= ONE_SESSION_MIN_BYTES


class OrtModel(CachedModel):
    """Sessions and KV cache of one model of a bundle (the bookkeeping is CachedModel's)."""

    def __init__(self, bundle: Bundle, role: str, providers=("CPUExecutionProvider",), threads: int | None = None,
                 spinning: bool | None = None, single_sequence: bool = True, shared_pool: bool = False,
                 one_session: bool | None = None):
        super().__init__(bundle, role)
        info = bundle.model(role)
        self._threads, self._spinning, self._providers = threads, spinning, list(providers)
        self.single_sequence = single_sequence  # run the batch-1 variants where the bundle has them
        self.shared_pool = shared_pool  # sessions run on the process-wide pool (see shared_thread_pool)
        # One session graph for every call of this model (compiler/session_graph.py): one copy of its
        # weights in memory, whatever the number of graphs a process runs; each call says its kind.
        self._session_graph = info.session if runs_one_session(bundle, role, one_session) else None
        self._variant_files = {e.single_sequence.file for e in bundle.manifest.graphs.values() if e.single_sequence}
        self._sessions: dict = {}  # graph file -> session
        self.session_source = "plain"  # a session graph's: "saved" optimized, "saving" it, or "plain" (saved_graphs.py)
        # (graph, first slot, batch) -> (session, binding, outputs, fed): resolved once, not per step
        self._calls: dict = {}
        self.cache: list[np.ndarray] = []  # each layer's K and V [slots, KV heads, max_seq, head dim], written in place
        self._views: dict = {}  # (first slot, batch) -> the cache's OrtValues over those slots
        # fail early on a broken bundle; others load on first use. Both of a head's: they run after every
        # target call, whatever the request's proposer (the head reads the target's features)
        first = [GraphId.eagle_catch_up(), GraphId.eagle_step()] if role == HEAD_ROLE else [GraphId.step(role, False)]
        for graph in first:
            self._session(graph, 1)

    def load_graphs(self, graphs: list[GraphId], batch: int | None = None) -> None:
        """Create the sessions these graphs run on at this batch size now, so that no generation
        times a session load."""
        for graph in graphs:
            self._session(graph, batch or self.slots)

    # -- what it holds (inspection, tests) ------------------------------------------------------
    @property
    def one_session(self) -> bool:
        """Every call runs on the model's one session graph (one copy of its weights)."""
        return self._session_graph is not None

    def verifiable_gammas(self, compiled: list[int]) -> list[int]:
        """Every γ up to the largest compiled, on a session graph (its verification takes γ from the
        width of its input); the compiled ones otherwise. At a low-bit target's costs on a CPU a
        verification of 5 tokens costs 2.5 decode steps and one of 2 tokens little more than one, so
        the γ the loop can afford is often below the one the bundle was built with."""
        if self._session_graph is None:
            return super().verifiable_gammas(compiled)
        return list(range(1, max(compiled) + 1))

    @property
    def loaded_files(self) -> set[str]:
        """The graph files whose computation has a session now."""
        return set(self._sessions)

    @property
    def session_count(self) -> int:
        """ONNX Runtime sessions held (one session graph serves many files)."""
        return len({id(s) for s in self._sessions.values()})

    # -- sessions and buffers -----------------------------------------------------------------
    def graph_file(self, graph: GraphId, batch: int) -> str:
        """The graph file whose computation a batch runs: a batch of one sequence runs the graph's
        single-sequence variant where the bundle has one (fused attention that reads the cache in
        place). With a session graph, that computation runs there (see _session, _binding)."""
        entry = self.bundle.graph(self._compiled(graph).name)
        if batch == 1 and entry.single_sequence and self.single_sequence:
            return entry.single_sequence.file
        return entry.file

    def _compiled(self, graph: GraphId) -> GraphId:
        """The bundle's graph whose computation `graph` is: itself, or, for a verification at a γ
        the bundle did not compile, on a session graph, the largest compiled γ's (the same call at
        another width: see verifiable_gammas)."""
        if graph.name in self.bundle.manifest.graphs:
            return graph
        if self._session_graph is not None and graph.gamma is not None and graph.gamma <= max(self.bundle.gammas):
            return GraphId(graph.model, graph.kind, max(self.bundle.gammas))
        raise SpecCompileError(f"graph {graph.name} is not in this bundle")

    def _session(self, graph: GraphId, batch: int):
        """The session that runs `graph` at this batch size: its file's own, or the model's one
        session graph. Sessions are kept by the file whose computation they run."""
        file = self.graph_file(graph, batch)
        if file not in self._sessions:
            if self._session_graph is None:
                self._sessions[file] = self._new_session(file)
            else:
                loaded = next(iter(self._sessions.values()), None)
                self._sessions[file] = loaded or self._new_session(self._session_graph.file)
        return self._sessions[file]

    def _new_session(self, file: str):
        options = session_options(self._threads, self._spinning, self.shared_pool)
        options.log_severity_level = 3  # a session graph's optional inputs have defaults, which it warns about
        if self._session_graph is not None and self._providers == ["CPUExecutionProvider"]:
            # a real-size model: its optimized graph is saved once per machine (saved_graphs.py)
            session, self.session_source = saved_graphs.open_session(self.bundle, file, options, self._providers)
            return session
        return _ort().InferenceSession(str(self.bundle.path / file), options, providers=self._providers)

    def _run(self, graph: GraphId, first: int, **inputs) -> dict[str, np.ndarray]:
        # a tree's, a verification's and a score's outputs are per position: bound arrays per width too
        width = inputs["input_ids"].shape[1] if graph.positions_scored == "all" else 0
        key = graph, first, len(inputs["input_ids"]), width
        session, binding, outputs, fed, features = self._calls.get(key) or self._prepare(*key)
        if self._session_graph is not None and "token_count" not in inputs:  # verification: every token is real
            inputs["token_count"] = np.full(key[2], inputs["input_ids"].shape[1], dtype=np.int64)
        for name, value in inputs.items():
            self._feed(binding, fed, name, np.asarray(value))
        if features:
            self._bind_features(binding, outputs, *inputs["input_ids"].shape)
        session.run_with_iobinding(binding)
        return outputs

    def _prepare(self, graph: GraphId, first: int, batch: int, width: int) -> tuple:
        """What a call of `graph` on these slots runs on: its session and its binding."""
        session = self._session(graph, batch)
        binding = self._binding(session, graph, self.graph_file(graph, batch), first, batch, width)
        features = AUX_HIDDEN in self.bundle.manifest.read_back(graph)
        self._calls[graph, first, batch, width] = (session, *binding, features)
        return self._calls[graph, first, batch, width]

    def _bind_features(self, binding, outputs: dict, batch: int, tokens: int) -> None:
        """aux_hidden [B, T, F] at this call's T: a step's or a verification's T is fixed, a prompt
        chunk's varies, so a new array is bound (and kept in `outputs`) when T changes."""
        held = outputs.get(AUX_HIDDEN)
        if held is None or held.shape[1] != tokens:
            shape, dtype = output_array(AUX_HIDDEN, batch, self.vocab_size, positions=tokens, hidden=self.output_width)
            outputs[AUX_HIDDEN] = np.zeros(shape, dtype=dtype)
            binding.bind_ortvalue_output(AUX_HIDDEN, _ort().OrtValue.ortvalue_from_numpy(outputs[AUX_HIDDEN]))

    @staticmethod
    def _feed(binding, fed: dict, name: str, value: np.ndarray) -> None:
        """Write an input into a buffer bound once per shape: binding a new array every call costs
        ONNX Runtime more (about 1.5 µs per input, measured on a draft step) than this copy."""
        buffer = fed.get(name)
        if buffer is not None and buffer[2] is value and not value.flags.writeable:
            return  # the same read-only array as last time (the inputs of processors that are off): in place
        if buffer is None or buffer[0].shape != value.shape or buffer[0].dtype != value.dtype:
            array = np.empty(value.shape, value.dtype)
            # the OrtValue wraps the array's own memory: a copy into the array is an input to the next run
            buffer = (array, _ort().OrtValue.ortvalue_from_numpy(array))
            binding.bind_ortvalue_input(name, buffer[1])
        np.copyto(buffer[0], value)
        fed[name] = (*buffer[:2], value)

    def _allocate(self, slots: int) -> None:
        shape = tuple(kv_cache_shape(self.kv_heads, self.head_dim, self.max_seq, slots))
        self.cache = [np.zeros(shape, dtype=np.float32) for _ in range(2 * self.num_layers)]
        self._views, self._calls = {}, {}

    def _copy_slot(self, source: int, destination: int, length: int) -> None:
        for array in self.cache:  # [slots, KV heads, max_seq, head dim]
            array[destination, :, :length] = array[source, :, :length]

    def _move_positions(self, slot: int, sources: np.ndarray, destinations: np.ndarray) -> None:
        for array in self.cache:
            array[slot, :, destinations] = array[slot, :, sources]

    def _cache_view(self, first: int, batch: int) -> list:
        """Each layer's K and V cache over slots first..first+batch-1, as OrtValues on the cache's own
        memory (a slice of slots is contiguous: slots are the outermost axis)."""
        if (first, batch) not in self._views:
            ort = _ort()
            self._views[first, batch] = [ort.OrtValue.ortvalue_from_numpy(a[first : first + batch])
                                         for a in self.cache]
        return self._views[first, batch]

    def _binding(self, session, graph: GraphId, file: str, first: int, batch: int, width: int = 0):
        """An IOBinding with the cache bound in place and the read-back outputs in reusable arrays:
        (binding, outputs, fed inputs). One per graph and slot range: with a session graph, one
        session runs several graphs' calls."""
        ort = _ort()
        binding = session.io_binding()
        cache = self._cache_view(first, batch)
        for i in range(self.num_layers):
            for k, kind_name in enumerate(("key", "value")):
                binding.bind_ortvalue_input(f"past_{kind_name}.{i}", cache[2 * i + k])
                binding.bind_ortvalue_output(f"present_{kind_name}.{i}", cache[2 * i + k])
        arrays = {}
        for name in self.bundle.manifest.read_back(graph):
            if name == AUX_HIDDEN:
                continue  # bound per call (_bind_features): its T is the call's
            shape, dtype = output_array(name, batch, self.vocab_size, width, positions=max(width, 1),
                                        hidden=self.output_width)
            arrays[name] = np.zeros(shape, dtype=dtype)
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(arrays[name]))
        fed = {}
        if self._session_graph is not None:  # constant for this binding: which call, which attention kernel
            self._feed(binding, fed, "kind", np.array(self._session_graph.kinds[graph.kind], dtype=np.int64))
            # the session graph's fused branch is causal: a tree takes the standard ops there
            self._feed(binding, fed, "fused", np.array(file in self._variant_files and not graph.tree))
        return binding, arrays, fed
