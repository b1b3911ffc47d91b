"""core/grammar.py: the masks a request's grammar state gives are llguidance's own at every position,
whatever drafts it was asked about before and rolled back; a lookahead is computed once; a lookup's
proposal is cut where the grammar refuses it; constraints that do not compile say why."""

import json

import numpy as np
import pytest

from speccompile.core.grammar import Constraint, GrammarEngine
from speccompile.errors import SpecCompileError
from tests.tiny_models import make_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"enum": ["small", "large"]},
                                           "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
          "required": ["name", "size", "tags"]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = make_tokenizer()
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(directory)
    return GrammarEngine(directory / "tokenizer.json", len(tokenizer), {tokenizer.eos_token_id})


def allowed(forbidden_row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(np.invert(forbidden_row).view(np.uint8), bitorder="little")[:vocab])


def fresh_mask(engine, constraint, tokens) -> np.ndarray:
    """The forbidden bits after `tokens`, from a matcher that never saw anything else."""
    from llguidance import LLMatcher

    matcher = LLMatcher(engine.tokenizer, constraint.llguidance_grammar())
    assert matcher.consume_tokens([int(t) for t in tokens])
    return np.invert(np.frombuffer(matcher.compute_bitmask(), np.int32))[: engine.words]


def test_masks_after_rolled_back_drafts_are_those_of_a_matcher_that_saw_only_the_kept_tokens(engine):
    constraint = Constraint.of(json_schema=SCHEMA)
    state = engine.start(constraint)
    rng = np.random.default_rng(0)
    committed = []
    for _ in range(12):
        drafted = []  # a random walk the grammar allows: what a draft model would propose
        for _ in range(4):
            choices = allowed(state.mask_after(drafted), engine.vocab_size)
            drafted.append(int(rng.choice(choices)))
        masks = np.zeros((5, engine.words), np.int32)
        state.masks(drafted, masks)
        for r in range(5):
            np.testing.assert_array_equal(masks[r], fresh_mask(engine, constraint, committed + drafted[:r]))
        kept = int(rng.integers(0, 4))  # some drafts kept, then a token of the target's own
        alternatives = allowed(masks[kept], engine.vocab_size)
        emitted = drafted[:kept] + [int(rng.choice(alternatives))]
        assert state.commit(emitted) == len(emitted)
        committed += emitted
        if state.finished:
            break
        np.testing.assert_array_equal(state.mask_after([]), fresh_mask(engine, constraint, committed))
    assert len(committed) > 12


class Counting:
    """A matcher that counts the masks computed through it."""

    def __init__(self, matcher):
        self.matcher, self.masks = matcher, 0

    def unsafe_compute_mask_ptr(self, *args):
        self.masks += 1
        return self.matcher.unsafe_compute_mask_ptr(*args)

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def test_a_verification_reuses_the_masks_its_draft_steps_computed(engine):
    state = engine.start(Constraint.of(json_schema=SCHEMA))
    state._matcher = counting = Counting(state._matcher)
    drafted = []
    for _ in range(4):  # the draft model's steps, each masked after the drafts before it
        drafted.append(int(allowed(state.mask_after(drafted), engine.vocab_size)[0]))
    state.masks(drafted, np.zeros((5, engine.words), np.int32))  # the verification of all four
    assert counting.masks == 5
    state.commit(drafted[:2] + [drafted[2]])  # three kept: the mask after them was computed already
    state.mask_after([])
    assert counting.masks == 5


def test_valid_prefix_cuts_a_proposal_where_the_grammar_refuses_it(engine):
    tokenizer = engine.tokenizer
    state = engine.start(Constraint.of(json_schema=SCHEMA))
    good = tokenizer.tokenize_str('{"name": "ab", "size": "small"')
    bad = tokenizer.tokenize_str('{"name": "ab", "colour": 1')
    assert state.valid_prefix(good) == len(good)
    cut = state.valid_prefix(bad)
    assert 0 < cut < len(bad) and bad[:cut] == good[:cut]
    assert state.commit(good) == len(good)  # asking about a refused proposal left the state intact


def test_the_text_of_every_constraint_kind_is_what_its_grammar_allows(engine):
    def accepts(constraint, text):
        state = engine.start(constraint)
        ids = engine.tokenizer.tokenize_str(text)
        return state.valid_prefix(ids) == len(ids) and state.commit(ids) == len(ids)

    assert accepts(Constraint.of(json_object=True), '{"a": [1, 2]}')
    assert not accepts(Constraint.of(json_object=True), '[1]')
    assert accepts(Constraint.of(regex="[0-9]{3}-[a-z]+"), "123-abc")
    assert not accepts(Constraint.of(regex="[0-9]{3}-[a-z]+"), "12-abc")
    assert accepts(Constraint.of(choice=["yes", "no"]), "no") and not accepts(Constraint.of(choice=["yes"]), "ye!")
    assert accepts(Constraint.of(grammar='start: "a" NUM\nNUM: /[0-9]+/'), "a42")
    assert accepts(Constraint.of(grammar='root ::= "x" [0-9]+'), "x7")  # GBNF, llama.cpp's
    assert not accepts(Constraint.of(grammar='root ::= "x" [0-9]+'), "y7")


@pytest.mark.parametrize("kwargs, message", [
    ({"json_schema": {"type": "wrong"}}, "json_schema does not compile: Invalid type"),
    ({"json_schema": "{not json"}, "json_schema is not JSON"),
    ({"json_schema": [1]}, "json_schema must be a JSON object"),
    ({"regex": "a(b"}, "regex does not compile"),
    ({"grammar": "start: missing_rule"}, "grammar does not compile"),
    ({"grammar": 'root ::= "a" other'}, "GBNF grammar does not convert"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"regex": "a", "json_object": True}, "give one constraint"),
])
def test_a_constraint_that_does_not_compile_says_why_in_one_line(engine, kwargs, message):
    with pytest.raises(SpecCompileError, match=message) as error:
        engine.start(Constraint.of(**kwargs))
    assert "\n" not in str(error.value)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_state(engine):
    constraint = Constraint.of(json_schema=json.dumps(SCHEMA))
    first, second = engine.start(constraint), engine.start(constraint)
    assert engine._compiled[constraint] is not None
    first.commit(engine.tokenizer.tokenize_str('{"name"'))
    np.testing.assert_array_equal(second.mask_after([]), fresh_mask(engine, constraint, []))


def test_a_rejected_eos_draft_leaves_the_state_where_the_kept_tokens_put_it(engine):
    """EOS is checked, never consumed: llguidance cannot roll a consumed EOS back, and a draft that
    ended early and was rejected must leave the grammar expecting what it expected."""
    constraint = Constraint.of(regex="[0-9]{1,3};")
    state = engine.start(constraint)
    digits = engine.tokenizer.tokenize_str("1")
    end = engine.tokenizer.tokenize_str(";")
    eos = engine.tokenizer.eos_token
    drafted = digits + end + [eos]
    assert state.valid_prefix(drafted) == len(drafted)
    assert allowed(state.mask_after(drafted), engine.vocab_size).tolist() == [eos]
    assert state.commit(digits + digits) == 2  # the target wrote another digit instead
    np.testing.assert_array_equal(state.mask_after([]), fresh_mask(engine, constraint, digits + digits))
