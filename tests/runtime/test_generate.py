"""End to end: bundle -> speculative greedy generation == autoregressive == HF generate, token for token."""

import itertools

import numpy as np
import pytest
import torch
import transformers

import speccompile
from speccompile.bundle import GraphId
from speccompile.errors import SpecCompileError
from tests.conftest import FAMILIES

PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [8, 9, 10, 11], [200], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
MAX_NEW = 24


def hf_greedy(checkpoint, prompt, max_new) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # attention_mask given explicitly: HF would otherwise mask prompt tokens equal to pad_token_id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_reference(checkpoints):
    cache = {}

    def get(family, prompt_index):
        key = family, prompt_index
        if key not in cache:
            cache[key] = hf_greedy(checkpoints(family), PROMPTS[prompt_index], MAX_NEW)
        return cache[key]

    return get


@pytest.mark.parametrize("one_session", [False, True], ids=["session per graph", "one session per model"])
@pytest.mark.parametrize("draft", ["copy", "random"])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_matches_autoregressive_and_hf(family, draft, one_session, bundles, hf_reference):
    runtime = speccompile.load(bundles(family, draft), one_session=one_session)
    expected = [hf_reference(family, i) for i in range(len(PROMPTS))]
    for gamma in (1, 4):
        one_by_one = [runtime.generate([p], max_new_tokens=MAX_NEW, gamma=gamma)[0].token_ids for p in PROMPTS]
        batched = [r.token_ids for r in runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, gamma=gamma)]
        assert one_by_one == expected, f"batch 1, γ={gamma}"
        assert batched == expected, f"batch of {len(PROMPTS)}, γ={gamma}"
    autoregressive = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, mode="autoregressive")
    assert [r.token_ids for r in autoregressive] == expected


def test_acceptance_statistics_reflect_the_draft(bundles):
    copy = speccompile.load(bundles("llama", "copy")).generate(PROMPTS[:2], max_new_tokens=MAX_NEW, gamma=4)
    random = speccompile.load(bundles("llama", "random")).generate(PROMPTS[:2], max_new_tokens=MAX_NEW, gamma=4)
    for r in copy:
        stats = r.stats
        # 23 tokens after the prefill's: four iterations of 4 drafts + the target's own, then one that
        # drafts only the 2 it still needs
        assert stats.acceptance_rate == 1.0 and stats.gammas_used == {4: 4, 2: 1}
        assert stats.accepted_tokens == stats.draft_tokens == 18 and stats.iterations == 5
        assert stats.mean_accepted_drafts == 3.6 and stats.mean_acceptance_length == 4.6
        assert stats.acceptance_by_position == [1.0] * 4
        assert stats.draft_ms > 0 and stats.verify_ms > 0 and stats.tokens_per_s > 0
    for r in random:
        assert r.stats.acceptance_rate < 0.5
        assert r.stats.iterations > copy[0].stats.iterations


def test_text_prompts_use_the_bundled_tokenizer(bundles, tokenizer):
    runtime = speccompile.load(bundles("llama", "copy"))
    text = "def parse_args(argv):"
    assert runtime.tokenizer.encode(text) == tokenizer(text)["input_ids"]
    [result] = runtime.generate([text], max_new_tokens=8)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.prompt == text
    assert len(result.token_ids) == 8 or result.token_ids[-1] in runtime.tokenizer.eos_token_ids


def test_kv_cache_is_updated_in_place(bundles):
    """The cache memory bound in and out is the one the graph writes: no copy per step."""
    runtime = speccompile.load(bundles("gpt2", "copy"))
    runtime.generate([PROMPTS[0]], max_new_tokens=4, mode="autoregressive")
    cache = runtime.target.cache[0]  # layer 0's keys, [slots, KV heads, max_seq, head dim]
    before, pointer = cache.copy(), cache.ctypes.data
    runtime.target.forward(np.array([[3]]), np.array([1]))
    assert runtime.target.cache[0].ctypes.data == pointer
    position = len(PROMPTS[0]) + 4 - 1  # prompt + 3 cached generated tokens
    changed = np.argwhere(np.any(cache != before, axis=(1, 3)))  # (slot, position) pairs written
    assert changed.tolist() == [[0, position]]


def test_streaming_callback_sees_every_token_in_order(bundles):
    runtime = speccompile.load(bundles("qwen2", "random"))
    seen = {0: [], 1: []}
    results = runtime.generate(PROMPTS[:2], max_new_tokens=10, on_tokens=lambda row, ids: seen[row].extend(ids))
    assert [seen[0], seen[1]] == [r.token_ids for r in results]


@pytest.mark.parametrize("temperature, graphs", [
    (0.0, [GraphId.verification(4, sample=False), GraphId("draft", "forward")]),
    (0.8, [GraphId.verification(4, sample=True), GraphId("draft", "sample")])])
def test_graphs_are_loaded_before_the_clock_starts(bundles, temperature, graphs):
    """Session loads (tens of ms) must not land in the first iteration's verify/draft time."""
    runtime = speccompile.load(bundles("llama", "random"))
    loaded_at_first_call = []
    verify = runtime.target.verify_sample if temperature else runtime.target.verify

    def spy(*args, **kwargs):
        loaded_at_first_call.append(runtime.target.loaded_files | runtime.draft.loaded_files)
        return verify(*args, **kwargs)

    setattr(runtime.target, "verify_sample" if temperature else "verify", spy)
    runtime.generate([PROMPTS[0]], max_new_tokens=4, gamma=4, temperature=temperature, seed=0)
    target_graph, draft_graph = graphs
    files = {runtime.target.graph_file(target_graph, 1), runtime.draft.graph_file(draft_graph, 1)}
    assert f"{target_graph.name}_b1.onnx" in files  # batch 1: the target's single-sequence variant
    assert loaded_at_first_call and files <= loaded_at_first_call[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "auto"])
def test_prompt_lookup_suffix_and_auto_match_hf(family, proposer, bundles, hf_reference):
    """Tiny random models repeat themselves, so lookups and suffixes match; the draft is unrelated, so
    under auto the free proposers draft too. Alone and in a batch, the tokens are HF's."""
    runtime = speccompile.load(bundles(family, "random"))
    expected = [hf_reference(family, i) for i in range(len(PROMPTS))]
    batched = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, gamma=4, proposer=proposer)
    alone = [runtime.generate([p], max_new_tokens=MAX_NEW, gamma=4, proposer=proposer)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == expected and [r.token_ids for r in alone] == expected
    free = ("ngram", "suffix") if proposer == "auto" else (proposer,)
    lookups = sum(r.stats.by_proposer.get(name, [0, 0, 0])[1] for r in batched + alone for name in free)
    assert lookups > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_confidence_thresholding_matches_hf(family, bundles, hf_reference):
    """The random draft is unsure of most tokens: at p_min 0.05 it drafts fewer, and the tokens are HF's."""
    runtime = speccompile.load(bundles(family, "random"))
    expected = [hf_reference(family, i) for i in range(len(PROMPTS))]
    full, thresholded = (runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, gamma=4, proposer="draft", p_min=p)
                         for p in (0.0, 0.05))
    assert [r.token_ids for r in thresholded] == [r.token_ids for r in full] == expected
    assert sum(r.stats.draft_tokens for r in thresholded) < sum(r.stats.draft_tokens for r in full)


@pytest.mark.parametrize("p_min", [-0.1, 1.5, "high", True])
def test_p_min_must_be_a_probability(bundles, p_min):
    with pytest.raises(SpecCompileError, match="p_min must be a probability"):
        speccompile.load(bundles("llama", "copy")).generate([PROMPTS[0]], max_new_tokens=4, p_min=p_min)


def test_one_sequence_runs_the_fused_variants_and_a_batch_the_standard_graphs(bundles, hf_reference):
    runtime = speccompile.load(bundles("llama", "copy"))
    [single] = runtime.generate([PROMPTS[0]], max_new_tokens=MAX_NEW, gamma=4)
    loaded = runtime.target.loaded_files | runtime.draft.loaded_files
    assert {"target_forward_b1.onnx", "target_verify_g4_b1.onnx", "draft_forward_b1.onnx"} <= loaded
    assert "target_verify_g4.onnx" not in runtime.target.loaded_files
    batch = runtime.generate(PROMPTS[:2], max_new_tokens=MAX_NEW, gamma=4)
    assert "target_verify_g4.onnx" in runtime.target.loaded_files
    assert single.token_ids == batch[0].token_ids == hf_reference("llama", 0)


def test_copy_draft_under_auto_gamma_accepts_every_drafted_position(bundles, monkeypatch):
    """γ = auto moving between the compiled γ (forced here: on tiny models the policy's choice
    follows timing noise): the statistics count each position over the iterations that drafted it."""
    from speccompile.core.gamma_policy import GammaPolicy

    runtime = speccompile.load(bundles("llama", "copy"))
    schedule = itertools.cycle([4, 1, 1])  # from the first request on (load serves a warm-up request of its own)
    monkeypatch.setattr(GammaPolicy, "choose", lambda self, allow_zero=True: next(schedule))
    # mode "speculative": a copy draft costs a target step, so drafting would not pay
    for stats in [r.stats for r in runtime.generate(PROMPTS[:2], max_new_tokens=MAX_NEW, gamma="auto",
                                                    mode="speculative")]:
        assert stats.mode == "speculative" and stats.gamma == "auto" and set(stats.gammas_used) == {1, 4}
        assert stats.acceptance_by_position == [1.0] * 4
        assert stats.mean_acceptance_length == pytest.approx(1 + stats.mean_gamma)
        assert stats.to_dict()["gamma"] == "auto"


def test_top_k_and_top_p_at_temperature_zero_are_warned_about(bundles, caplog):
    runtime = speccompile.load(bundles("llama", "copy"))
    caplog.set_level("WARNING", logger="speccompile")
    greedy = runtime.generate([PROMPTS[0]], max_new_tokens=4, top_k=5, top_p=0.9)[0]
    assert [line for line in caplog.messages if "no effect at temperature 0" in line] == [
        "warning: top_k=5 has no effect at temperature 0 (greedy decoding); set a temperature to sample",
        "warning: top_p=0.9 has no effect at temperature 0 (greedy decoding); set a temperature to sample"]
    assert greedy.token_ids == runtime.generate([PROMPTS[0]], max_new_tokens=4)[0].token_ids
    caplog.clear()
    runtime.generate([PROMPTS[0]], max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9, seed=0)
    assert caplog.messages == []


def test_a_gamma_in_autoregressive_mode_is_warned_about(bundles, caplog):
    runtime = speccompile.load(bundles("llama", "copy"))
    caplog.set_level("WARNING", logger="speccompile")
    [result] = runtime.generate([PROMPTS[0]], max_new_tokens=4, mode="autoregressive", gamma=4)
    assert caplog.messages == ["warning: gamma=4 has no effect in autoregressive mode (the target decodes alone)"]
    assert result.stats.mode == "autoregressive" and result.stats.gamma == 0
