"""Chat templates rendered as transformers' `apply_chat_template` renders them, without transformers.

The environment is transformers' (tested against `apply_chat_template` on several templates in
tests/serve/test_chat.py): a sandboxed Jinja environment that trims blocks, with `loopcontrols`
(`break`, `continue`), the `{% generation %}` tag (rendered as its body), a `tojson` that keeps
non-ASCII text and takes indent/separators/sort_keys, `raise_exception`, `strftime_now`, and the
tokenizer's special tokens by name (bos_token, eos_token, ...). Templates are untrusted code from a
checkpoint: the sandbox keeps them from attributes and methods outside plain data.

Messages reach the template as clients send them to OpenAI, with two conversions vLLM also makes:
content given as a list of text parts is joined into one string (with "\\n"), and a `developer`
message (OpenAI's newer name for the system role) is passed as `system` to a template that does not
name the developer role.
"""

import contextvars
import json
import time
from datetime import datetime

from jinja2.exceptions import SecurityError

from speccompile.errors import SpecCompileError


def render_chat(template: str, special_tokens: dict[str, str], messages: list[dict], tools: list | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                extra: dict | None = None) -> str:
    """The prompt text of a conversation. continue_final_message: the text ends inside the last
    message (an assistant turn to continue), without its end-of-turn marker. Raises
    SpecCompileError with the template's own message when it refuses the conversation."""
    import jinja2

    messages = [_plain_message(m, "developer" in template) for m in messages]
    if continue_final_message and (not messages or not isinstance(messages[-1].get("content"), str)):
        raise SpecCompileError("continue_final_message needs a last message with text content")
    marker = "\u0000CONTINUE\u0000"
    if continue_final_message:
        messages[-1]["content"] += marker
    if len(template) > TEMPLATE_MAX_CHARS:
        raise SpecCompileError(f"the chat template is {len(template):,} characters, over the {TEMPLATE_MAX_CHARS:,} "
                               "a template may be")
    budget = Budget()
    token = _BUDGET.set(budget)
    try:
        chunks = []
        for chunk in _environment().from_string(template).generate(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **(extra or {}), **special_tokens):
            chunks.append(chunk)
            budget.wrote(len(chunk))
        text = "".join(chunks)
    except jinja2.TemplateError as e:
        raise SpecCompileError(f"the chat template refused these messages: {e}") from None
    except (RecursionError, MemoryError, OverflowError):
        raise SpecCompileError("the chat template failed on these messages (it recursed or grew without "
                               "bound)") from None
    finally:
        _BUDGET.reset(token)
    if continue_final_message:
        if marker not in text:
            raise SpecCompileError("continue_final_message: the chat template does not render the last message")
        text = text[: text.rindex(marker)]
    return text


def _plain_message(message: dict, template_names_developer: bool) -> dict:
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        kinds = {part.get("type") for part in content}
        if kinds - {"text"}:
            raise SpecCompileError(f"content parts of type {', '.join(sorted(map(str, kinds - {'text'})))} are not "
                                   "supported: this server takes text")
        message["content"] = "\n".join(part["text"] for part in content)
    if message.get("role") == "developer" and not template_names_developer:
        message["role"] = "system"
    return message


# A template is code from the checkpoint (or the bundle's maker): it renders in a sandbox, within these
# bounds, checked as it runs: every range() it iterates counts, every piece it writes, every `*` and
# `**` it computes; past a bound it stops with an error (a 400), never a hung or exhausted server.
TEMPLATE_MAX_CHARS = 1 << 20
RENDER_MAX_CHARS = 4 << 20
RENDER_MAX_ITEMS = 1_000_000  # items all of one render's range() calls may yield
RENDER_MAX_SECONDS = 2.0


class Budget:
    """One render's use of the bounds."""

    def __init__(self):
        self.started, self.items, self.chars = time.perf_counter(), 0, 0

    def step(self) -> None:
        self.items += 1
        if self.items > RENDER_MAX_ITEMS or (self.items % 1024 == 0 and self._late()):
            raise SecurityError(f"the template ran past {RENDER_MAX_ITEMS:,} loop items or {RENDER_MAX_SECONDS} s")

    def wrote(self, chars: int) -> None:
        self.chars += chars
        if self.chars > RENDER_MAX_CHARS or self._late():
            raise SecurityError(f"the template wrote past {RENDER_MAX_CHARS:,} characters or {RENDER_MAX_SECONDS} s")

    def _late(self) -> bool:
        return time.perf_counter() - self.started > RENDER_MAX_SECONDS


_BUDGET: contextvars.ContextVar = contextvars.ContextVar("chat_template_budget")


def _bounded_range(*args):
    budget = _BUDGET.get()
    for item in range(*args):
        budget.step()
        yield item


def _environment():
    """transformers' chat-template environment (utils/chat_template_utils.py), made once, with the
    render bounds above."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Bounded(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**"})

            def call_binop(self, context, operator, left, right):
                """`*` and `**` whose result would be larger than a render may write."""
                sizes = [len(v) for v in (left, right) if isinstance(v, (str, list, tuple))]
                counts = [v for v in (left, right) if isinstance(v, int) and not isinstance(v, bool)]
                if operator == "*" and sizes and counts and sizes[0] * max(counts[0], 0) > RENDER_MAX_CHARS:
                    raise SecurityError("the template multiplies a sequence past what a render may write")
                if operator == "**" and counts and len(counts) == 2 and abs(right) > 64:
                    raise SecurityError("the template raises a number to too large a power")
                return super().call_binop(context, operator, left, right)

        class Generation(jinja2.ext.Extension):
            """{% generation %}...{% endgeneration %}: marks an assistant's text (for training masks);
            renders its body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
        environment.globals["range"] = _bounded_range
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENVIRONMENT = environment
    return _ENVIRONMENT


_ENVIRONMENT = None


def read_template(path) -> str:
    """--chat-template: a file holding a Jinja template (or a JSON string of one, as tokenizer configs store it)."""
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise SpecCompileError(f"--chat-template {path}: no such file")
    text = file.read_text()
    if text.startswith('"'):
        try:
            text = json.loads(text)
        except json.JSONDecodeError:
            pass
    if not text.strip():
        raise SpecCompileError(f"--chat-template {path}: the file is empty")
    return text
