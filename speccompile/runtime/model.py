"""What both backends share: the engine interface of `core/engine.py` as cache-length bookkeeping
over one primitive, "run this graph on slots first..first+B-1 with these inputs".

A backend (onnxruntime_engine.OrtModel, tensorrt_engine.TrtModel) supplies that primitive (`_run`),
allocates the cache (`_allocate`) and copies a slot's entries (`_copy_slot`); the lengths, the
rollback and the meaning of every call live here, once.

An EAGLE-3 head (role "eagle") is a model of the same kind with calls of its own, `catch_up` and
`step`, and their sampled twins (core/proposers/eagle.py's engine); the target of its bundle leaves
each call's features in `last_aux_hidden` for it.
"""

import numpy as np

from speccompile.bundle import AUX_HIDDEN, Bundle, GraphId
from speccompile.core.sampling import Logprobs
from speccompile.core.tree import TokenTree, compaction

# what the logits processors read (compiler/logits.py): a call's `processing` gives each of them, [B, ...]
PROCESSING = {"penalties": (4, np.float32), "counts": ("vocab", np.float32), "seen": ("vocab", np.float32),
              "logit_bias": ("vocab", np.float32), "banned": ("vocab", np.float32), "ban_until": (None, np.int64),
              "forbidden": ("mask bytes", np.uint8)}


def _constant(value) -> np.ndarray:
    array = np.array(value)
    array.flags.writeable = False  # fed again as is, never copied again (onnxruntime_engine._feed)
    return array


ON, OFF = _constant(True), _constant(False)


class CachedModel:
    """One model of a bundle: its KV cache for a number of slots and their cache lengths."""

    def __init__(self, bundle: Bundle, role: str):
        info = bundle.model(role)
        self.bundle, self.role = bundle, role
        self.num_layers, self.kv_heads, self.head_dim = info.num_layers, info.num_kv_heads, info.head_dim
        self.max_seq, self.vocab_size = bundle.max_seq, bundle.vocab_size
        # the last dimension of the read-back outputs that have one: the target's aux_hidden [B, T, F]
        # (bundle.output_array), the head's hidden [B, H]
        self.output_width = info.aux_hidden_width or info.hidden_size
        self.slots = 0
        self.cache_lengths = np.zeros(0, dtype=np.int64)
        self._zeros: dict[tuple, tuple] = {}  # shape of the noise -> (coupled, noise) that no row reads
        self._processing_off: dict[tuple, dict] = {}  # (batch, positions) -> processing inputs no call reads
        self.last_logprobs: Logprobs | None = None  # the last call's that asked for them (logprobs=True)
        # the last step's or verification's aux_hidden [B, T, F] (T: its input width), where its graph
        # returns them (a bundle built for an EAGLE-3 head), else None; valid until the next call
        self.last_aux_hidden: np.ndarray | None = None

    def verifiable_gammas(self, compiled: list[int]) -> list[int]:
        """The γ a verification can run at, given the bundle's compiled ones: each compiled γ is a
        graph of its own here (a backend whose one graph verifies any width says more)."""
        return sorted(compiled)

    @property
    def weight_bytes(self) -> int:
        """The size of this model's weights file in the bundle."""
        return (self.bundle.path / self.bundle.model(self.role).weights_file).stat().st_size

    # -- the engine interface -------------------------------------------------------------------
    def start(self, slots: int) -> None:
        if slots > self.slots:
            self._allocate(slots)
            self.slots = slots
        self.cache_lengths = np.zeros(self.slots, dtype=np.int64)

    def forward(self, tokens: np.ndarray, token_count: np.ndarray, first: int = 0, processing: dict | None = None,
                logprobs: bool = False) -> np.ndarray:
        return self.forward_confident(tokens, token_count, first, processing, logprobs)[0]

    def forward_confident(self, tokens: np.ndarray, token_count: np.ndarray, first: int = 0,
                          processing: dict | None = None, logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        rows = self._rows(first, len(tokens))
        out = self._run(GraphId.step(self.role, sample=False), first, input_ids=tokens,
                        past_len=self.cache_lengths[rows], token_count=token_count,
                        **self._switches(len(tokens), processing, logprobs))
        self.cache_lengths[rows] += token_count
        self._keep(out, logprobs)
        return out["next_token"].copy(), out["confidence"].copy()

    def forward_sample(self, tokens, token_count, params, uniform, coupled=None, noise=None, first: int = 0,
                       processing: dict | None = None, logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        rows = self._rows(first, len(tokens))
        if coupled is None:  # every row by inverse CDF: the noise is never read
            coupled, noise = self._unread(len(tokens), (len(tokens), self.vocab_size))
        out = self._run(GraphId.step(self.role, sample=True), first, input_ids=tokens,
                        past_len=self.cache_lengths[rows], token_count=token_count, uniform=uniform, coupled=coupled,
                        noise=noise, **params, **self._switches(len(tokens), processing, logprobs))
        self.cache_lengths[rows] += token_count
        self._keep(out, logprobs)
        return out["next_token"].copy(), out["probs"].copy()

    def _unread(self, batch: int, shape: tuple) -> tuple[np.ndarray, np.ndarray]:
        """coupled all False and a noise of zeros, made once per shape: the inputs of a sampling call
        in which no row is coupled (the graphs' shapes are fixed, so the noise is fed all the same)."""
        if shape not in self._zeros:
            self._zeros[shape] = np.zeros(batch, bool), np.zeros(shape, np.float32)
        return self._zeros[shape]

    def _switches(self, batch: int, processing: dict | None, logprobs: bool, positions: int = 1) -> dict:
        """The processors' inputs (read-only zeros, made once per batch size and number of scored
        positions, for what does not apply) and the switches of processing and log-probabilities."""
        if (batch, positions) not in self._processing_off:
            off = {name: _constant(np.zeros(self._processing_shape(batch, width, positions), dtype))
                   for name, (width, dtype) in PROCESSING.items()}
            self._processing_off[batch, positions] = off | {"process": OFF, "constrain": OFF}
        off = self._processing_off[batch, positions]
        return {**off, **(processing or {}), "want_logprobs": ON if logprobs else OFF}

    def _processing_shape(self, batch: int, width, positions: int) -> tuple:
        if width == "mask bytes":  # a grammar's forbidden bits per scored position (core/grammar.py)
            return batch, positions, 4 * ((self.vocab_size + 31) // 32)
        return (batch,) if width is None else (batch, self.vocab_size if width == "vocab" else width)

    def _keep(self, out: dict, logprobs: bool) -> None:
        """What a step or verification leaves for who reads it after the call: its log-probabilities
        (when asked for) and its features (aux_hidden, not copied: read before the next call)."""
        self.last_aux_hidden = out.get(AUX_HIDDEN)
        if logprobs:
            self.last_logprobs = Logprobs(out["token_logprob"].copy(), out["top_logprobs"].copy(),
                                          out["top_ids"].copy())

    def verify(self, tokens: np.ndarray, draft_len: np.ndarray, first: int = 0, processing: dict | None = None,
               logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        rows = self._rows(first, len(tokens))
        out = self._run(GraphId.verification(tokens.shape[1] - 1, sample=False), first, input_ids=tokens,
                        past_len=self.cache_lengths[rows], draft_len=draft_len,
                        **self._switches(len(tokens), processing, logprobs, tokens.shape[1]))
        self.cache_lengths[rows] = out["new_len"]
        self._keep(out, logprobs)
        return out["accepted"].copy(), out["next_token"].copy()

    def verify_sample(self, tokens, draft_len, draft_probs, params, u_accept, u_sample, coupled=None, noise=None,
                      first: int = 0, processing: dict | None = None,
                      logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        rows = self._rows(first, len(tokens))
        if coupled is None:  # every row by rejection sampling: the noise is never read
            coupled, noise = self._unread(len(tokens), (len(tokens), tokens.shape[1], self.vocab_size))
        out = self._run(GraphId.verification(tokens.shape[1] - 1, sample=True), first, input_ids=tokens,
                        past_len=self.cache_lengths[rows], draft_len=draft_len, draft_probs=draft_probs,
                        u_accept=u_accept, u_sample=u_sample, coupled=coupled, verify_noise=noise, **params,
                        **self._switches(len(tokens), processing, logprobs, tokens.shape[1]))
        self.cache_lengths[rows] = out["new_len"]
        self._keep(out, logprobs)
        return out["accepted"].copy(), out["next_token"].copy()

    def score(self, tokens: np.ndarray, score_ids: np.ndarray, first: int = 0) -> Logprobs:
        """Prefill tokens [B, T] (every one real) and return each position's log-probability of
        score_ids [B, T] (the tokens that follow) and its most likely tokens: a prompt's scores (echo)."""
        rows = self._rows(first, len(tokens))
        out = self._run(GraphId.score(), first, input_ids=tokens, past_len=self.cache_lengths[rows],
                        score_ids=score_ids)
        self.cache_lengths[rows] += tokens.shape[1]
        return Logprobs(out["token_logprob"].copy(), out["top_logprobs"].copy(), out["top_ids"].copy())

    def verify_tree(self, tokens: np.ndarray, draft_len: np.ndarray, tree: TokenTree, typical: tuple | None = None,
                    first: int = 0, forbidden: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """forbidden [B, N, 4W] uint8: each node's grammar mask (core/processors.grammar_masks), None: no
        row is constrained."""
        rows = self._rows(first, len(tokens))
        past_len = self.cache_lengths[rows].copy()
        off = self._switches(len(tokens), None, False, tree.size)
        feeds = {"input_ids": tokens, "past_len": past_len, "draft_len": draft_len, "tree_parents": tree.parents,
                 "tree_depths": tree.depths, "tree_ranks": tree.ranks, "tree_mask": tree.ancestors,
                 "constrain": OFF if forbidden is None else ON,
                 "forbidden": off["forbidden"] if forbidden is None else forbidden}
        if typical is not None:
            feeds["typical_epsilon"], feeds["typical_delta"] = (np.full(len(tokens), v, np.float32) for v in typical)
        out = self._run(GraphId.tree_verification(typical is not None), first, **feeds)
        for row, node in enumerate(out["best_node"]):  # the accepted path's entries into place (core/tree.py)
            sources, destinations = compaction(tree, int(node))
            if len(sources):
                self._move_positions(first + row, past_len[row] + sources, past_len[row] + destinations)
        self.cache_lengths[rows] = out["new_len"]
        return out["best_node"].copy(), out["next_token"].copy(), out["next_tree"].copy()

    # -- an EAGLE-3 head's calls (role "eagle"; compiler/eagle_graph.py) --------------------------
    def catch_up(self, tokens: np.ndarray, features: np.ndarray, counts: np.ndarray,
                 first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read the target's features [B, T, F] with the tokens after them [B, T], counts[b] of row b
        (right-padded; 0: none), at each row's cache length on: (next_token, confidence, hidden [B, H])
        after each row's last position read (a row that read nothing: an answer nobody takes)."""
        rows = self._rows(first, len(tokens))
        past_len = self.cache_lengths[rows]
        # every row writes T positions (TensorScatter), its padding included, so they must fit the cache:
        # a row that reads nothing writes where its length says nothing is (its cache length is unchanged)
        past_len = np.where(counts > 0, past_len, np.minimum(past_len, self.max_seq - tokens.shape[1]))
        out = self._run(GraphId.eagle_catch_up(), first, input_ids=tokens, aux_hidden=features, past_len=past_len,
                        token_count=counts)
        self.cache_lengths[rows] += counts
        return out["next_token"].copy(), out["confidence"].copy(), out["hidden"].copy()

    def tree_catch_up(self, tokens: np.ndarray, features: np.ndarray, counts: np.ndarray,
                      first: int = 0) -> tuple[np.ndarray, ...]:
        """catch_up that also returns the best tokens after each row's last position read, the first
        level of a dynamic tree: (next_token, confidence, hidden [B, H], top_ids [B, K] (target ids),
        top_logprobs [B, K])."""
        rows = self._rows(first, len(tokens))
        past_len = np.where(counts > 0, self.cache_lengths[rows],
                            np.minimum(self.cache_lengths[rows], self.max_seq - tokens.shape[1]))
        out = self._run(GraphId.eagle_tree("tree_catch_up"), first, input_ids=tokens, aux_hidden=features,
                        past_len=past_len, token_count=counts)
        self.cache_lengths[rows] += counts
        return (out["next_token"].copy(), out["confidence"].copy(), out["hidden"].copy(), out["top_ids"][:, 0].copy(),
                out["top_logprobs"][:, 0].copy())

    def tree_step(self, tokens: np.ndarray, hidden: np.ndarray, positions: np.ndarray, visible: np.ndarray,
                  first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """T nodes of each row's dynamic tree [B, T], each with its parent's output hidden [B, T, H], at
        its own position [B, T], seeing the keys visible [B, T, L] marks (L: the cache length + T),
        written at the row's cache length on: (top_ids [B, T, K], top_logprobs [B, T, K], node_hidden
        [B, T, H]). The caller keeps every row's nodes within the cache."""
        rows = self._rows(first, len(tokens))
        out = self._run(GraphId.eagle_tree("tree_step"), first, input_ids=tokens, hidden_in=hidden,
                        past_len=self.cache_lengths[rows], positions=positions, visible=visible)
        self.cache_lengths[rows] += tokens.shape[1]
        return out["top_ids"].copy(), out["top_logprobs"].copy(), out["node_hidden"].copy()

    def verify_eagle_tree(self, tokens: np.ndarray, tree: TokenTree, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The target over a dynamic tree's tokens [B, N] (node 0 the last accepted token; every node
        verified), greedy: (best_node [B], next_token [B]); the accepted path's cache entries moved into
        place, and every node's features kept (last_aux_hidden [B, N, F], in node order)."""
        rows = self._rows(first, len(tokens))
        past_len = self.cache_lengths[rows].copy()
        off = self._switches(len(tokens), None, False, tree.size)
        out = self._run(GraphId.eagle_tree("verify_eagle_tree"), first, input_ids=tokens, past_len=past_len,
                        draft_len=np.full(len(tokens), tree.size - 1, dtype=np.int64), tree_parents=tree.parents,
                        tree_depths=tree.depths, tree_mask=tree.ancestors, constrain=OFF, forbidden=off["forbidden"])
        for row, node in enumerate(out["best_node"]):
            sources, destinations = compaction(tree, int(node))
            if len(sources):
                self._move_positions(first + row, past_len[row] + sources, past_len[row] + destinations)
        self.cache_lengths[rows] = out["new_len"]
        self._keep(out, False)
        return out["best_node"].copy(), out["next_token"].copy()

    @property
    def drafts_trees(self) -> bool:
        """As a head: whether it has a dynamic tree's graphs (tree_catch_up, tree_step). As a target:
        whether it verifies such trees (its bundle has the graph, and, on one session graph, that
        graph serves the tree's kind: a bundle built before it did verifies chains only)."""
        session = getattr(self, "_session_graph", None)
        return self.bundle.eagle_trees and (session is None or "verify_eagle_tree" in session.kinds)

    @property
    def samples_drafts(self) -> bool:
        """Whether the head has its sampled graphs (catch_up_sample, step_sample): drafts for sampled requests."""
        return self.bundle.eagle_samples

    def catch_up_sample(self, tokens: np.ndarray, features: np.ndarray, counts: np.ndarray, params: dict,
                        uniform: np.ndarray, coupled=None, noise=None,
                        first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """catch_up with each row's draft drawn as forward_sample draws (params: temperature, top_k, top_p;
        uniform [B]; coupled [B] and noise [B, V], or None when no row is coupled): (next_token, probs
        [B, V] it was drawn from, hidden [B, H])."""
        rows = self._rows(first, len(tokens))
        past_len = np.where(counts > 0, self.cache_lengths[rows],
                            np.minimum(self.cache_lengths[rows], self.max_seq - tokens.shape[1]))
        if coupled is None:
            coupled, noise = self._unread(len(tokens), (len(tokens), self.vocab_size))
        out = self._run(GraphId.eagle_catch_up(sample=True), first, input_ids=tokens, aux_hidden=features,
                        past_len=past_len, token_count=counts, uniform=uniform, coupled=coupled, noise=noise, **params)
        self.cache_lengths[rows] += counts
        return out["next_token"].copy(), out["probs"].copy(), out["hidden"].copy()

    def step_sample(self, tokens: np.ndarray, hidden: np.ndarray, params: dict, uniform: np.ndarray, coupled=None,
                    noise=None, first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """step with each row's draft drawn as catch_up_sample draws; returns as it does."""
        rows = self._rows(first, len(tokens))
        if coupled is None:
            coupled, noise = self._unread(len(tokens), (len(tokens), self.vocab_size))
        out = self._run(GraphId.eagle_step(sample=True), first, input_ids=tokens, hidden_in=hidden,
                        past_len=np.minimum(self.cache_lengths[rows], self.max_seq - 1), uniform=uniform,
                        coupled=coupled, noise=noise, **params)
        self.cache_lengths[rows] += 1
        return out["next_token"].copy(), out["probs"].copy(), out["hidden"].copy()

    def step(self, tokens: np.ndarray, hidden: np.ndarray, first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One more position of every row: its draft tokens [B, 1] with the head's last output hidden
        [B, 1, H]; returns as catch_up does. Rows that do not draft step too, and one at the cache's end
        would write past it: it writes its last position instead, past the length it is rolled back to
        (the runner's after_target) before anything reads there."""
        rows = self._rows(first, len(tokens))
        out = self._run(GraphId.eagle_step(), first, input_ids=tokens, hidden_in=hidden,
                        past_len=np.minimum(self.cache_lengths[rows], self.max_seq - 1))
        self.cache_lengths[rows] += 1
        return out["next_token"].copy(), out["confidence"].copy(), out["hidden"].copy()

    def move(self, source: int, destination: int) -> None:
        length = int(self.cache_lengths[source])
        self._copy_slot(source, destination, length)
        self.cache_lengths[destination] = length

    def load_graphs(self, graphs: list[GraphId], batch: int | None = None) -> None:
        """Load what these graphs run on at this batch size now (default: every slot)."""

    # -- what a backend supplies ------------------------------------------------------------------
    def _run(self, graph: GraphId, first: int, **inputs) -> dict[str, np.ndarray]:
        """Run `graph` on slots first..first+B-1 (B: the inputs' batch) with the cache bound in place;
        returns the outputs the runtime reads back (bundle.Manifest.read_back)."""
        raise NotImplementedError

    def _allocate(self, slots: int) -> None:
        raise NotImplementedError

    def _copy_slot(self, source: int, destination: int, length: int) -> None:
        """Copy the first `length` cached positions of every layer's K and V."""
        raise NotImplementedError

    def _move_positions(self, slot: int, sources: np.ndarray, destinations: np.ndarray) -> None:
        """Copy one slot's cached entries at positions `sources` to `destinations`, in every layer's K
        and V (in order: core/tree.compaction makes that safe)."""
        raise NotImplementedError

    def _rows(self, first: int, batch: int) -> slice:
        assert 0 <= first and first + batch <= self.slots, f"slots {first}..{first + batch - 1} of {self.slots}"
        return slice(first, first + batch)
