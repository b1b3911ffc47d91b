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

import json
from datetime import datetime

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
    try:
        text = _environment().from_string(template).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **(extra or {}), **special_tokens)
    except jinja2.TemplateError as e:
        raise SpecCompileError(f"the chat template refused these messages: {e}") from None
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


def _environment():
    """transformers' chat-template environment (utils/chat_template_utils.py), made once."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

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

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[Generation, jinja2.ext.loopcontrols])
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
