"""A torch reference of an EAGLE-3 head drafting greedily, and random heads to run it on.

The pairing follows the EAGLE authors' drafting loop (eagle/model/cnets.py, `topK_genrate`): the
target has run over tokens x_0 .. x_{T-1}, giving aux hidden states a_0 .. a_{T-1}, and produced
x_T from its last position. The head's position t carries (fc(a_t), embed(x_{t+1})): the features
of position t with the token the target produced from there, at RoPE position t (the authors drop
the first token, `input_ids[:, 1:]`, and count positions from 0; speculators' training counts them
from 1, the same attention under RoPE). The head's output at T - 1 gives the first draft d_1; each
further draft feeds back the head's own (pre-norm) output with the previous draft's embedding at the
next position, T, T + 1, ..., through the same one-layer KV cache.
"""

import dataclasses
import math

import numpy as np
import torch

from speccompile.eagle_head import Eagle3Config, Eagle3Head, draft_to_target


class Eagle3Reference:
    """The head and its KV cache; positions are counted by the cache (the prompt's, then the drafts')."""

    def __init__(self, head: Eagle3Head, embed_tokens: np.ndarray | None = None, dtype=torch.float64):
        assert head.config.rope_scaling is None, "the reference does plain RoPE only"
        embed = head.embed_tokens if embed_tokens is None else embed_tokens
        assert embed is not None, "a head without its own embedding drafts with the target's"
        self.head, self.c, self.dtype = head, head.config, dtype
        self.embed = torch.as_tensor(np.asarray(embed), dtype=dtype)
        self.keys = torch.zeros(0, self.c.num_key_value_heads, self.c.head_dim, dtype=dtype)
        self.values = self.keys.clone()

    def w(self, name: str) -> torch.Tensor:
        return torch.as_tensor(getattr(self.head, name), dtype=self.dtype)

    def fuse(self, aux_hidden) -> torch.Tensor:
        """[n, 3·Ht] target features -> [n, H]."""
        return torch.as_tensor(np.asarray(aux_hidden), dtype=self.dtype) @ self.w("fc").T

    def forward(self, hidden: torch.Tensor, tokens) -> torch.Tensor:
        """The layer over n new positions: hidden [n, H] (fused features or the head's own output),
        tokens [n] target ids; appends their keys and values to the cache. Returns [n, H]."""
        fed = self._rms(hidden, "hidden_norm")
        residual = fed if self.c.norm_before_residual else hidden
        emb = self._rms(self.embed[torch.as_tensor(np.asarray(tokens), dtype=torch.long)], "input_layernorm")
        attended = residual + self._attention(torch.cat([emb, fed], dim=-1))
        y = self._rms(attended, "post_attention_layernorm")
        return attended + (torch.nn.functional.silu(y @ self.w("gate_proj").T) * (y @ self.w("up_proj").T)) \
            @ self.w("down_proj").T

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the head's output."""
        return self._rms(hidden, "norm") @ self.w("lm_head").T

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w(name) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        positions = torch.arange(len(self.keys), len(self.keys) + n)
        q = self._rope(x @ self.w("q_proj").T, c.num_attention_heads, positions)
        self.keys = torch.cat([self.keys, self._rope(x @ self.w("k_proj").T, c.num_key_value_heads, positions)])
        self.values = torch.cat([self.values, (x @ self.w("v_proj").T).view(n, c.num_key_value_heads, c.head_dim)])
        group = c.num_attention_heads // c.num_key_value_heads
        keys, values = self.keys.repeat_interleave(group, dim=1), self.values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(c.head_dim)
        visible = torch.arange(len(keys))[None, :] <= positions[:, None]  # causal over the whole cache
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", weights, values).reshape(n, -1) @ self.w("o_proj").T

    def _rope(self, x: torch.Tensor, heads: int, positions: torch.Tensor) -> torch.Tensor:
        """HF Llama's rotary embedding: dimension i pairs with i + head_dim / 2."""
        d = self.c.head_dim
        x = x.view(len(positions), heads, d)
        inv_freq = 1.0 / self.c.rope_theta ** (torch.arange(0, d, 2, dtype=self.dtype) / d)
        angles = positions.to(self.dtype)[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * cos + rotated * sin


def draft(head: Eagle3Head, aux_hidden: np.ndarray, tokens, k: int,
          embed_tokens: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """k greedy drafts after a prompt: aux_hidden [T, 3·Ht] at the target's positions 0..T-1, tokens
    [T + 1] (the prompt and the token the target produced from its last position). Returns the drafts
    as target ids [k] and the head's hidden states [T + k - 1, H]: one per prompt position, then one
    per draft fed back (all but the last draft)."""
    tokens = np.asarray(tokens)
    assert len(tokens) == len(aux_hidden) + 1, f"{len(tokens)} tokens for {len(aux_hidden)} positions"
    ref = Eagle3Reference(head, embed_tokens)
    with torch.no_grad():
        hidden = [ref.forward(ref.fuse(aux_hidden), tokens[1:])]
        drafts = []
        for _ in range(k):
            drafts.append(int(draft_to_target(head, int(ref.logits(hidden[-1][-1]).argmax()))))
            if len(drafts) < k:
                hidden.append(ref.forward(hidden[-1][-1:], [drafts[-1]]))
    return np.array(drafts, np.int64), torch.cat(hidden).numpy()


# ---------------------------------------------------------------------------------------------
# random heads


def random_head(target_config: dict, seed: int = 0, norm_before_residual: bool = False, draft_vocab_size: int = 50,
                aux_layer_ids: tuple[int, ...] | None = None, num_heads: int = 4, num_kv_heads: int = 2,
                with_embedding: bool = False, rope_theta: float = 10000.0) -> Eagle3Head:
    """A head for `target_config` (a HF config dict: hidden_size, vocab_size) with random weights,
    seeded. fc is scaled up so that its output is far from unit RMS: taking the residual before or
    after hidden_norm then changes the drafts. The draft vocabulary is a random subset of the target's."""
    rng = np.random.default_rng(seed)
    hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
    config = Eagle3Config(
        hidden_size=hidden, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden // num_heads, intermediate_size=2 * hidden, rms_norm_eps=1e-6, rope_theta=rope_theta,
        rope_scaling=None, draft_vocab_size=draft_vocab_size, vocab_size=vocab, target_hidden_size=hidden,
        aux_layer_ids=aux_layer_ids, norm_before_residual=norm_before_residual)
    used = np.sort(rng.choice(vocab, size=draft_vocab_size, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[used] = True

    def linear(out: int, inputs: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inputs)) * gain / math.sqrt(inputs)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.3 * rng.standard_normal(hidden)).astype(np.float32)

    q, kv = num_heads * config.head_dim, num_kv_heads * config.head_dim
    return Eagle3Head(
        config=config, fc=linear(hidden, 3 * hidden, gain=4.0), input_layernorm=norm(), hidden_norm=norm(),
        q_proj=linear(q, 2 * hidden), k_proj=linear(kv, 2 * hidden), v_proj=linear(kv, 2 * hidden),
        o_proj=linear(hidden, q), post_attention_layernorm=norm(), gate_proj=linear(2 * hidden, hidden),
        up_proj=linear(2 * hidden, hidden), down_proj=linear(hidden, 2 * hidden), norm=norm(),
        lm_head=linear(draft_vocab_size, hidden, gain=4.0), d2t=(used - np.arange(draft_vocab_size)).astype(np.int64),
        t2d=t2d, embed_tokens=rng.standard_normal((vocab, hidden)).astype(np.float32) if with_embedding else None)


def with_config(head: Eagle3Head, **changes) -> Eagle3Head:
    """The same weights under a changed config (e.g. norm_before_residual flipped)."""
    return dataclasses.replace(head, config=dataclasses.replace(head.config, **changes))
