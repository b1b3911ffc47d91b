"""EAGLE-3 heads: both published layouts load to one record, the record fits (or is refused by) a
target, and the torch reference that later tests compare against is itself checked by hand."""

import json
import math

import numpy as np
import pytest

from speccompile.eagle_head import (
    CONFIG,
    WEIGHTS,
    Layout,
    aux_layer_ids,
    check_fits,
    draft_to_target,
    head_tensors,
    load_eagle3_head,
    published_names,
    with_draft_vocab,
    write_eagle3_head,
)
from speccompile.errors import SpecCompileError
from tests.eagle_reference import Eagle3Reference, draft, random_head, with_config
from tests.tiny_models import EMBEDDING_PADDING, VOCAB

TARGET = {"model_type": "llama", "hidden_size": 64, "vocab_size": VOCAB + EMBEDDING_PADDING, "num_hidden_layers": 8}


def prompt(seed: int = 0, length: int = 6):
    """Target features at `length` positions and the `length + 1` tokens that go with them."""
    rng = np.random.default_rng(100 + seed)
    aux = rng.standard_normal((length, 3 * TARGET["hidden_size"])).astype(np.float32)
    return aux, rng.integers(0, TARGET["vocab_size"], length + 1)


def target_embedding(seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((TARGET["vocab_size"], TARGET["hidden_size"]))


def assert_same_record(a, b):
    assert a.config == b.config
    ta, tb = head_tensors(a), head_tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and np.array_equal(ta[name], tb[name]), name


# -- the two layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("with_embedding", [False, True])
def test_both_layouts_load_to_the_same_record_and_draft_alike(tmp_path, with_embedding):
    head = random_head(TARGET, seed=1, norm_before_residual=True, aux_layer_ids=(1, 4, 6),
                       with_embedding=with_embedding)
    loaded = {layout: load_eagle3_head(write_eagle3_head(tmp_path / layout.value, head, layout)) for layout in Layout}
    for each in loaded.values():
        assert_same_record(each, head)
    aux, tokens = prompt()
    embed = None if with_embedding else target_embedding()
    drafts = [draft(each, aux, tokens, k=4, embed_tokens=embed) for each in loaded.values()]
    assert np.array_equal(drafts[0][0], drafts[1][0]) and np.array_equal(drafts[0][1], drafts[1][1])


def test_written_files_use_the_published_names(tmp_path):
    from safetensors import safe_open

    head = random_head(TARGET, aux_layer_ids=(2, 4, 5))
    eagle = json.loads((write_eagle3_head(tmp_path / "e", head, Layout.EAGLE) / CONFIG).read_text())
    spec = json.loads((write_eagle3_head(tmp_path / "s", head, Layout.SPECULATORS) / CONFIG).read_text())
    assert eagle["architectures"] == ["LlamaForCausalLMEagle3"] and eagle["draft_vocab_size"] == 50
    assert eagle["hidden_size"] == 64 and "norm_before_residual" not in eagle
    assert spec["speculators_model_type"] == "eagle3" and spec["norm_before_residual"] is False
    assert spec["transformer_layer_config"]["num_key_value_heads"] == 2
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    with safe_open(str(tmp_path / "e" / WEIGHTS), "numpy") as f:
        assert "midlayer.self_attn.q_proj.weight" in f.keys() and f.get_tensor("fc.weight").shape == (64, 192)
        assert f.get_tensor("midlayer.self_attn.k_proj.weight").shape == (32, 128)  # 2 KV heads of 16, from 2H
    with safe_open(str(tmp_path / "s" / WEIGHTS), "numpy") as f:
        assert set(f.keys()) == set(published_names(Layout.SPECULATORS).values()) - {"embed_tokens.weight"}
        assert f.get_tensor("d2t").dtype == np.int64 and f.get_tensor("t2d").dtype == bool


def test_half_precision_files_load_as_float32(tmp_path):
    """float16 as written here; bfloat16 as torch writes it (numpy has no bfloat16)."""
    import torch
    from safetensors.torch import save_file

    head = random_head(TARGET, seed=2)
    half = load_eagle3_head(write_eagle3_head(tmp_path / "f16", head, Layout.EAGLE, dtype="float16"))
    assert half.fc.dtype == np.float32 and np.array_equal(half.fc, head.fc.astype(np.float16).astype(np.float32))
    out = write_eagle3_head(tmp_path / "bf16", head, Layout.SPECULATORS)
    names = published_names(Layout.SPECULATORS)
    save_file({names[n]: torch.from_numpy(a).to(torch.bfloat16) if a.dtype == np.float32 else torch.from_numpy(a)
               for n, a in head_tensors(head).items()}, str(out / WEIGHTS))
    bf16 = load_eagle3_head(out)
    assert np.array_equal(bf16.lm_head, torch.from_numpy(head.lm_head).to(torch.bfloat16).float().numpy())
    assert np.array_equal(bf16.d2t, head.d2t) and np.array_equal(bf16.t2d, head.t2d)


def test_a_sharded_head_loads(tmp_path):
    from safetensors.numpy import save_file

    head = random_head(TARGET, seed=3)
    out = write_eagle3_head(tmp_path / "h", head, Layout.EAGLE)
    names = published_names(Layout.EAGLE)
    tensors = {names[name]: array for name, array in head_tensors(head).items()}
    shards = {"model-00001-of-00002.safetensors": dict(list(tensors.items())[:7]),
              "model-00002-of-00002.safetensors": dict(list(tensors.items())[7:])}
    for file, part in shards.items():
        save_file(part, str(out / file))
    (out / WEIGHTS).unlink()
    weight_map = {name: file for file, part in shards.items() for name in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_record(load_eagle3_head(out), head)


# -- what the config means ---------------------------------------------------------------------------


def test_norm_before_residual_is_read_and_changes_the_drafts(tmp_path):
    before = random_head(TARGET, seed=4, norm_before_residual=True)
    after = with_config(before, norm_before_residual=False)
    aux, tokens = prompt(1)
    embed = target_embedding()
    (drafts_before, hidden_before), (drafts_after, hidden_after) = (draft(h, aux, tokens, 5, embed)
                                                                    for h in (before, after))
    assert not np.allclose(hidden_before, hidden_after)
    assert not np.array_equal(drafts_before, drafts_after)
    for head, layout in [(before, Layout.SPECULATORS), (after, Layout.EAGLE), (before, Layout.EAGLE)]:
        loaded = load_eagle3_head(write_eagle3_head(tmp_path / "h", head, layout))
        assert loaded.config.norm_before_residual == head.config.norm_before_residual
        assert np.array_equal(draft(loaded, aux, tokens, 5, embed)[0], draft(head, aux, tokens, 5, embed)[0])


def test_a_missing_norm_before_residual_defaults_per_layout(tmp_path):
    """The EAGLE authors' layer takes the residual before hidden_norm; vLLM reads speculators' field as true."""
    head = random_head(TARGET, seed=5)
    for layout, default in [(Layout.EAGLE, False), (Layout.SPECULATORS, True)]:
        out = write_eagle3_head(tmp_path / layout.value, head, layout)
        config = json.loads((out / CONFIG).read_text())
        config.pop("norm_before_residual", None)
        (out / CONFIG).write_text(json.dumps(config))
        assert load_eagle3_head(out).config.norm_before_residual is default


def test_d2t_maps_every_draft_id_to_a_target_id_t2d_marks(tmp_path):
    head = load_eagle3_head(write_eagle3_head(tmp_path / "h", random_head(TARGET, seed=6), Layout.SPECULATORS))
    targets = draft_to_target(head, np.arange(head.config.draft_vocab_size))
    assert head.t2d[targets].all() and len(set(targets.tolist())) == head.config.draft_vocab_size
    assert head.t2d.sum() == head.config.draft_vocab_size and (targets < head.config.vocab_size).all()
    drafts, _ = draft(head, *prompt(2), k=6, embed_tokens=target_embedding())
    assert head.t2d[drafts].all()


def test_a_cut_vocabulary_drafts_the_full_heads_token_wherever_it_kept_it(tmp_path):
    """with_draft_vocab keeps lm_head's rows of the chosen target ids: the cut head's greedy draft is the
    whole head's wherever that is one of them, and always one of them; written and read back whole."""
    head = random_head(TARGET, seed=6)
    targets = draft_to_target(head, np.arange(head.config.draft_vocab_size))
    kept = np.sort(np.random.default_rng(0).choice(targets, 20, replace=False))
    cut = load_eagle3_head(write_eagle3_head(tmp_path / "h", with_draft_vocab(head, kept), Layout.EAGLE))
    assert cut.config.draft_vocab_size == 20 and cut.lm_head.shape == (20, head.config.hidden_size)
    assert np.array_equal(draft_to_target(cut, np.arange(20)), kept)
    assert np.flatnonzero(cut.t2d).tolist() == kept.tolist()
    hidden = np.random.default_rng(1).standard_normal((200, head.config.hidden_size)).astype(np.float32)
    whole = targets[(hidden @ head.lm_head.T).argmax(-1)]
    part = draft_to_target(cut, (hidden @ cut.lm_head.T).argmax(-1))
    inside = np.isin(whole, kept)
    assert 0 < inside.sum() < len(whole) and np.array_equal(part[inside], whole[inside])
    assert np.isin(part, kept).all()
    with pytest.raises(SpecCompileError, match="target ids it drafts"):
        with_draft_vocab(head, np.setdiff1d(np.arange(TARGET["vocab_size"]), targets)[:3])


def test_an_unreduced_vocabulary_needs_no_maps(tmp_path):
    """A head drafting over the whole target vocabulary may leave d2t and t2d out: identity maps."""
    from safetensors.numpy import load_file, save_file

    out = write_eagle3_head(tmp_path / "h", random_head(TARGET, draft_vocab_size=TARGET["vocab_size"]), Layout.EAGLE)
    tensors = load_file(str(out / WEIGHTS))
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, str(out / WEIGHTS))
    head = load_eagle3_head(out)
    assert not head.d2t.any() and head.t2d.all()


def test_aux_layer_ids_default_and_given(tmp_path):
    head = random_head(TARGET)
    assert aux_layer_ids(head, 8) == (2, 4, 5) and aux_layer_ids(head, 32) == (2, 16, 29)
    out = write_eagle3_head(tmp_path / "h", head, Layout.EAGLE)
    config = json.loads((out / CONFIG).read_text())
    (out / CONFIG).write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [7, 1, 3]}))
    assert aux_layer_ids(load_eagle3_head(out), 8) == (1, 3, 7)  # the order the target's forward meets them
    # model-optimizer's exports: under eagle_config, the layers whose output feeds the head
    (out / CONFIG).write_text(json.dumps({**config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    assert aux_layer_ids(load_eagle3_head(out), 8) == (2, 4, 5)


# -- refusals ----------------------------------------------------------------------------------------


def refused(call, *phrases) -> str:
    with pytest.raises(SpecCompileError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and all(p in message for p in phrases), message
    return message


def test_a_head_that_fits_passes():
    check_fits(random_head(TARGET), TARGET)
    check_fits(random_head(TARGET), {"text_config": TARGET})  # a multimodal target's text model


@pytest.mark.parametrize("target, phrases", [
    ({**TARGET, "hidden_size": 32}, ("hidden size 64", "is 32")),
    ({**TARGET, "vocab_size": 300}, (f"{TARGET['vocab_size']} tokens", "has 300")),
    ({**TARGET, "num_hidden_layers": 5}, ("layer 6", "5 layers")),
    ({**TARGET, "num_hidden_layers": 6}, ("layer 6", "ids 0..5")),  # 6 would be the last layer's output
    ({**TARGET, "num_hidden_layers": None}, ("num_hidden_layers",)),
])
def test_a_head_for_another_target_is_refused(target, phrases):
    refused(lambda: check_fits(random_head(TARGET, aux_layer_ids=(2, 4, 6)), target), *phrases)


def test_the_default_aux_layers_need_seven_target_layers():
    refused(lambda: check_fits(random_head(TARGET), {**TARGET, "num_hidden_layers": 6}), "[2, 3, 3]",
            "eagle_aux_hidden_state_layer_ids")
    check_fits(random_head(TARGET), {**TARGET, "num_hidden_layers": 7})


def edit_config(out, **changes):
    config = json.loads((out / CONFIG).read_text())
    (out / CONFIG).write_text(json.dumps({**config, **changes}))


def edit_tensors(out, change):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(out / WEIGHTS))
    change(tensors)
    save_file(tensors, str(out / WEIGHTS))


def test_broken_heads_are_refused_in_one_line(tmp_path):
    def fresh(layout=Layout.EAGLE):
        return write_eagle3_head(tmp_path / "h", random_head(TARGET, seed=8), layout)

    out = fresh()
    edit_tensors(out, lambda t: t.pop("midlayer.hidden_norm.weight"))
    refused(lambda: load_eagle3_head(out), "midlayer.hidden_norm.weight", "missing")
    out = fresh(Layout.SPECULATORS)
    edit_tensors(out, lambda t: t.update({"layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    refused(lambda: load_eagle3_head(out), "layers.0.self_attn.q_proj.bias", "not part of")
    out = fresh()
    edit_tensors(out, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:40]}))
    refused(lambda: load_eagle3_head(out), "lm_head", "[40, 64]", "[50, 64]")
    out = fresh()
    edit_tensors(out, lambda t: t["d2t"].__setitem__(3, t["d2t"][3] + 1))
    refused(lambda: load_eagle3_head(out), "draft id 3", "t2d")
    out = fresh()
    edit_config(out, eagle_aux_hidden_state_layer_ids=[2, 2, 5])
    refused(lambda: load_eagle3_head(out), "three distinct")
    out = fresh(Layout.SPECULATORS)
    edit_config(out, speculators_model_type="eagle")
    refused(lambda: load_eagle3_head(out), "not an EAGLE-3 head")


def test_a_directory_that_is_no_head_is_refused(tmp_path, checkpoints):
    refused(lambda: load_eagle3_head(tmp_path), "not an EAGLE-3 head", "no config.json")
    refused(lambda: load_eagle3_head(checkpoints("llama")), "not an EAGLE-3 head", "LlamaForCausalLM")
    out = write_eagle3_head(tmp_path / "h", random_head(TARGET), Layout.EAGLE)
    (out / WEIGHTS).rename(out / "pytorch_model.bin")
    refused(lambda: load_eagle3_head(out), "pytorch_model.bin", "torch")
    (out / "pytorch_model.bin").unlink()
    refused(lambda: load_eagle3_head(out), "no model.safetensors")
    (out / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    refused(lambda: load_eagle3_head(out), "cannot read safetensors file")


# -- the reference, checked by hand ----------------------------------------------------------------


def numpy_layer(head, embed, fused_or_hidden, token_ids, positions, cache):
    """One position at a time, one head at a time, rotation pair by pair: the layer as written in the
    paper's terms, to check the batched torch reference. cache: lists of per-position keys and values."""
    c, out = head.config, []
    group, d = c.num_attention_heads // c.num_key_value_heads, c.head_dim

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x) + c.rms_norm_eps)

    def rotate(vec, pos):
        res = vec.copy()
        for i in range(d // 2):
            angle = pos / c.rope_theta ** (2 * i / d)
            a, b = vec[i], vec[i + d // 2]
            cos, sin = math.cos(angle), math.sin(angle)
            res[i], res[i + d // 2] = a * cos - b * sin, b * cos + a * sin
        return res

    for g, token, pos in zip(fused_or_hidden, token_ids, positions):
        normed = rms(g, head.hidden_norm)
        x = np.concatenate([rms(embed[token], head.input_layernorm), normed])
        q, k, v = (head.q_proj @ x).reshape(-1, d), (head.k_proj @ x).reshape(-1, d), (head.v_proj @ x).reshape(-1, d)
        cache["k"].append([rotate(k[j], pos) for j in range(c.num_key_value_heads)])
        cache["v"].append(v)
        heads = []
        for h in range(c.num_attention_heads):
            qh = rotate(q[h], pos)
            scores = np.array([qh @ keys[h // group] for keys in cache["k"]]) / math.sqrt(d)
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            heads.append(sum(w * values[h // group] for w, values in zip(weights, cache["v"])))
        a = (normed if c.norm_before_residual else g) + head.o_proj @ np.concatenate(heads)
        y = rms(a, head.post_attention_layernorm)
        gate = head.gate_proj @ y
        out.append(a + head.down_proj @ (gate / (1 + np.exp(-gate)) * (head.up_proj @ y)))
    return np.array(out)


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_the_reference_matches_the_layer_computed_by_hand(norm_before_residual):
    """A 3-position prompt then two drafts fed back: every hidden state and every draft."""
    head = random_head(TARGET, seed=9, norm_before_residual=norm_before_residual, rope_theta=50.0)
    head = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in head_tensors(head).items()} | \
        {"config": head.config}
    from speccompile.eagle_head import Eagle3Head

    head = Eagle3Head(**head)
    embed = target_embedding()
    aux, tokens = prompt(3, length=3)
    drafts, hidden = draft(head, aux, tokens, k=3, embed_tokens=embed)

    cache = {"k": [], "v": []}
    by_hand = [numpy_layer(head, embed, aux.astype(np.float64) @ head.fc.T, tokens[1:], [0, 1, 2], cache)]
    by_hand_drafts = []
    for step in range(3):
        logits = head.lm_head @ (head.norm * by_hand[-1][-1] / np.sqrt(np.mean(by_hand[-1][-1] ** 2) + 1e-6))
        by_hand_drafts.append(int(logits.argmax()) + int(head.d2t[logits.argmax()]))
        if step < 2:
            by_hand.append(numpy_layer(head, embed, by_hand[-1][-1:], [by_hand_drafts[-1]], [3 + step], cache))
    np.testing.assert_allclose(hidden, np.concatenate(by_hand), rtol=1e-9, atol=1e-9)
    assert drafts.tolist() == by_hand_drafts


def test_the_reference_cache_continues_where_it_stopped():
    """Prefilling in two calls gives what one call gives: positions and the cache carry over."""
    import torch

    head = random_head(TARGET, seed=10)
    aux, tokens = prompt(4, length=5)
    embed = target_embedding()
    whole, parts = Eagle3Reference(head, embed), Eagle3Reference(head, embed)
    with torch.no_grad():
        one = whole.forward(whole.fuse(aux), tokens[1:])
        two = torch.cat([parts.forward(parts.fuse(aux[:2]), tokens[1:3]),
                         parts.forward(parts.fuse(aux[2:]), tokens[3:])])
    torch.testing.assert_close(one, two)
