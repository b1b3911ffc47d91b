"""n samples of one prompt: the first prefills it, the others copy its cache and prefill only its last
token, and each sample is what it would be with a prefill of its own."""

import numpy as np

import speccompile


def prefilled_tokens(runtime) -> list[int]:
    """Count the prompt tokens the target's prefill chunks compute (calls of more than one token)."""
    counted = []

    def counting(call):
        def counted_call(tokens, token_count, *args, **kwargs):
            if tokens.shape[1] > 1:
                counted.append(int(token_count.sum()))
            return call(tokens, token_count, *args, **kwargs)
        return counted_call

    runtime.target.forward = counting(runtime.target.forward)
    runtime.target.forward_sample = counting(runtime.target.forward_sample)
    return counted


def test_samples_share_their_prompt_s_prefill_and_match_samples_prefilled_alone(bundles):
    runtime = speccompile.load(bundles("llama"))
    prompt = runtime.tokenizer.encode("x y x y z x y")
    options = {"max_new_tokens": 10, "temperature": 0.9, "seed": 11, "gamma": 4}
    counted = prefilled_tokens(runtime)
    shared = runtime.generate([prompt], n=4, **options)
    assert counted == [len(prompt)]  # one prefill of the whole prompt; the others compute its last token alone
    counted.clear()
    # the same four streams, each request prefilling its own prompt (the four rows of one call)
    alone = runtime.generate([prompt, list(prompt), list(prompt), list(prompt)], **options)
    assert counted == [4 * len(prompt)]
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in shared}) == 4  # distinct samples
    greedy = runtime.generate([prompt], n=3, max_new_tokens=8, gamma=4)
    assert all(r.token_ids == greedy[0].token_ids for r in greedy)
    assert np.all([r.prompt == prompt for r in greedy])
    runtime.close()
