"""Response bodies in OpenAI's shapes: choices (text or chat message), log-probabilities (the legacy
completions object, or chat's `content` list), usage, and our speculative statistics.

Log-probabilities are the target's own (core/processors.py, compiler/logits.py), the same with
speculation or without. A token the graphs report as impossible (-inf) is written as -9999.0, as
vLLM writes it (JSON has no infinity). In the completions object each position's `top_logprobs`
holds the `logprobs` most likely tokens and the chosen one, as vLLM's does.
"""

import json
import math

IMPOSSIBLE = -9999.0


class Shape:
    """One response's id, creation time, model, kind (text completion or chat), samples per prompt,
    echo and log-probabilities, and its bodies."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool, tokenizer, n: int = 1,
                 echo: bool = False, echo_only: bool = False, logprobs: int | None = None):
        self.id, self.created, self.model, self.chat, self.n = response_id, created, model, chat, n
        self.tokenizer, self.echo, self.echo_only, self.logprobs = tokenizer, echo, echo_only, logprobs
        self.object = "chat.completion" if chat else "text_completion"

    def body(self, results: list, handles: list) -> dict:
        """A whole response: a choice per result, usage over all, and the speculative statistics (top
        level for one choice, as llama.cpp's `timings`; in each choice when there are several)."""
        prompt_tokens = [len(h.request.prompt) for h in handles]
        choices = []
        for index, (result, handle) in enumerate(zip(results, handles)):
            tokens, text = ([], "") if self.echo_only else (result.token_ids, result.text)
            choice = {"index": index, "finish_reason": finish_reason(result),
                      "logprobs": self.choice_logprobs(handle, result, tokens)}
            text = (self.prompt_text(handle) if self.echo else "") + text
            choice |= {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            if len(results) > 1:
                choice |= speculative_stats(result, prompt_tokens[index])
            choices.append(choice)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage(results, prompt_tokens, self.n, self.echo_only)}
        return body | (speculative_stats(results[0], prompt_tokens[0]) if len(results) == 1 else {})

    def prompt_text(self, handle) -> str:
        prompt = handle.prompt
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt))

    def choice_logprobs(self, handle, result, tokens: list[int]) -> dict | None:
        """A choice's log-probabilities: with echo, the prompt's first (its first token has none)."""
        if self.logprobs is None:
            return None
        entries = list(result.logprobs or [])[: len(tokens)]
        if self.chat:
            return {"content": [self.chat_entry(t, e) for t, e in zip(tokens, entries)]}
        ids, scored = list(tokens), list(entries)
        if self.echo:
            prompt = list(handle.request.prompt)
            ids, scored = prompt + ids, [None, *(result.prompt_logprobs or [])] + scored
        return self.completion_logprobs(ids, scored)

    def completion_logprobs(self, ids: list[int], entries: list, offset: int = 0) -> dict:
        texts = self.tokenizer.token_texts(ids)
        offsets = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
        top = []
        for token, entry in zip(ids, entries):
            if entry is None:
                top.append(None)
                continue
            chosen, top_ids, top_values = entry
            listed = dict(zip(self.tokenizer.token_texts(top_ids[: self.logprobs]),
                              map(finite, top_values[: self.logprobs])))
            listed.setdefault(self.tokenizer.token_texts([token])[0], finite(chosen))
            top.append(listed)
        return {"tokens": texts, "token_logprobs": [None if e is None else finite(e[0]) for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def chat_entry(self, token: int, entry) -> dict:
        chosen, top_ids, top_values = entry
        text = self.tokenizer.token_texts([token])[0]
        top = [{"token": t, "logprob": finite(v), "bytes": list(t.encode())}
               for t, v in zip(self.tokenizer.token_texts(top_ids[: self.logprobs]), top_values[: self.logprobs])]
        return {"token": text, "logprob": finite(chosen), "bytes": list(text.encode()), "top_logprobs": top}

    def delta_logprobs(self, tokens: list[int], entries: list) -> dict | None:
        """A stream chunk's log-probabilities: those of the tokens it delivers."""
        if self.logprobs is None or not tokens:
            return None
        if self.chat:
            return {"content": [self.chat_entry(t, e) for t, e in zip(tokens, entries)]}
        return self.completion_logprobs(tokens, entries)

    def chunk(self, index: int, text: str, reason: str | None, first: bool = False, logprobs=None,
              usage_so_far: dict | None = None) -> str:
        """One server-sent event of a stream: choice `index`'s next text (and, as vLLM's
        continuous_usage_stats, the usage so far)."""
        choice = {"index": index, "finish_reason": reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return self.event({"choices": [choice]} | ({"usage": usage_so_far} if usage_so_far is not None else {}))

    def event(self, fields: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                      **fields}) + "\n\n"


def finite(value: float) -> float:
    return value if math.isfinite(value) and value > IMPOSSIBLE else IMPOSSIBLE


def finish_reason(result) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def usage(results: list, prompt_tokens: list[int], n: int, echo_only: bool = False) -> dict:
    """OpenAI's usage: a prompt sampled n times counts once."""
    prompts = sum(prompt_tokens[::n])
    completion = 0 if echo_only else sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompts, "completion_tokens": completion, "total_tokens": prompts + completion}


def speculative_stats(result, prompt_tokens: int) -> dict:
    s = result.stats
    timings = {"prompt_n": prompt_tokens, "prompt_ms": s.prefill_ms,
               "predicted_n": len(result.token_ids), "predicted_ms": s.total_ms - s.prefill_ms,
               "draft_n": s.draft_tokens, "draft_n_accepted": s.accepted_tokens}
    stats = s.to_dict()
    speculative = {key: stats[key] for key in ("mode", "acceptance_rate", "mean_acceptance_length", "mean_gamma",
                                               "gammas_used", "by_proposer")}
    # per draft position (from 0, as the metrics label them): drafts proposed there, and kept
    speculative["drafted_by_position"], speculative["accepted_by_position"] = list(s.drafted_at), list(s.accepted_at)
    return {"timings": timings, "speculative": speculative}
