"""Chat templates render as transformers' apply_chat_template renders them: templates in the styles
of real checkpoints (ChatML with tools, Llama 3's dated system header, Mistral's alternation check
with loop controls, Gemma's roles, a developer role and a generation block), rendered by both."""

import pytest

from speccompile.errors import SpecCompileError
from speccompile.runtime.tokenizer import Tokenizer
from speccompile.serve.chat import read_template, render_chat

CHATML_TOOLS = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are helpful.{% endif %}
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and (loop.first and not tools) or message.role in ['user', 'assistant'] %}
<|im_start|>{{ message.role }}
{{ message.content }}{% if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_DATED = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}

{{ system_message }}<|eot_id|>
{%- for message in messages %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_STRICT = """{%- set ns = namespace(seen=0) %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}{% continue %}{% endif %}
{%- if (message['role'] == 'user') != (ns.seen % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set ns.seen = ns.seen + 1 %}
{%- if message['role'] == 'user' %}{{ bos_token if loop.first else '' }}[INST] {{ message['content'] }} [/INST]
{%- else %}{{ message['content'] }}{{ eos_token }}{% endif %}
{%- if ns.seen > 6 %}{% break %}{% endif %}
{%- endfor %}"""

GEMMA_ROLES = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}
{{ raise_exception('System role not supported') }}{% endif %}
{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}
{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"""

DEVELOPER_GENERATION = """{% for m in messages %}{% if m.role == 'developer' %}[dev] {{ m.content }}
{% elif m.role == 'assistant' %}{% generation %}[bot] {{ m.content }}{% endgeneration %}
{% else %}[{{ m.role }}] {{ m.content }}
{% endif %}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city: ünïcode kept",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x y"},
                {"role": "assistant", "content": "y x"}, {"role": "user", "content": "  x  "}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "1", "content": "18 C"}]

CASES = [
    ("chatml", CHATML_TOOLS, CONVERSATION, None),
    ("chatml-tools", CHATML_TOOLS, TOOL_CONVERSATION, TOOLS),
    ("llama3-dated", LLAMA3_DATED, CONVERSATION, None),
    ("mistral-loop-controls", MISTRAL_STRICT, CONVERSATION, None),
    ("gemma-roles", GEMMA_ROLES, CONVERSATION[1:], None),
    ("developer-generation", DEVELOPER_GENERATION, [{"role": "developer", "content": "d"}, *CONVERSATION[1:]], None),
]


@pytest.fixture(scope="module")
def tokenizers(checkpoints):
    """(transformers' tokenizer, ours) of a checkpoint with bos/eos/pad tokens."""
    from transformers import AutoTokenizer

    directory = checkpoints("llama")
    return AutoTokenizer.from_pretrained(directory), Tokenizer(directory, {})


@pytest.mark.parametrize("name, template, messages, tools", CASES, ids=[c[0] for c in CASES])
def test_templates_render_as_transformers_renders_them(tokenizers, name, template, messages, tools):
    theirs, ours = tokenizers
    for generation_prompt in (True, False):
        expected = theirs.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                              add_generation_prompt=generation_prompt)
        got = render_chat(template, ours.special_tokens(), messages, tools, add_generation_prompt=generation_prompt)
        assert got == expected


def test_a_template_s_own_refusal_is_one_clear_error(tokenizers):
    _, ours = tokenizers
    with pytest.raises(SpecCompileError, match="refused these messages: System role not supported"):
        render_chat(GEMMA_ROLES, ours.special_tokens(), CONVERSATION)
    with pytest.raises(SpecCompileError, match="must alternate"):
        render_chat(MISTRAL_STRICT, ours.special_tokens(), [{"role": "user", "content": "a"}] * 2)


def test_text_parts_are_joined_and_developer_is_system_where_the_template_has_no_developer():
    template = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat(template, {}, parts, add_generation_prompt=False) == "system:a\nb;"
    assert render_chat(template + "{# developer #}", {}, parts, add_generation_prompt=False) == "developer:a\nb;"
    with pytest.raises(SpecCompileError, match="image_url are not supported"):
        render_chat(template, {}, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_continue_final_message_ends_inside_the_last_message(tokenizers):
    theirs, ours = tokenizers
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}]
    expected = theirs.apply_chat_template(messages, chat_template=CHATML_TOOLS, tokenize=False,
                                          continue_final_message=True)
    got = render_chat(CHATML_TOOLS, ours.special_tokens(), messages, add_generation_prompt=False,
                      continue_final_message=True)
    assert got == expected and got.endswith("The answer is")


def test_the_sandbox_keeps_templates_from_python_internals():
    with pytest.raises(SpecCompileError, match="refused"):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", {}, [{"role": "user", "content": "x"}])


def test_a_chat_template_file_is_read_as_jinja_or_as_a_json_string(tmp_path):
    (tmp_path / "plain.jinja").write_text("{{ messages[0].content }}")
    (tmp_path / "quoted.json").write_text('"{{ messages[0].content }}\\n"')
    assert read_template(tmp_path / "plain.jinja") == "{{ messages[0].content }}"
    assert read_template(tmp_path / "quoted.json") == "{{ messages[0].content }}\n"
    with pytest.raises(SpecCompileError, match="no such file"):
        read_template(tmp_path / "missing.jinja")


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loop items"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 100 }}{% endfor %}{% endfor %}",
     "characters"),
    ("{{ 'x' * 1000000000 }}", "multiplies a sequence"),
    ("{{ 10 ** 1000000000 }}", "too large a power"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
], ids=["nested loops", "huge output", "huge string", "huge power", "recursion"])
def test_a_hostile_template_stops_at_its_bounds_with_one_error(template, message):
    import time

    started = time.perf_counter()
    with pytest.raises(SpecCompileError, match=message):
        render_chat(template, {}, [{"role": "user", "content": "x"}])
    assert time.perf_counter() - started < 10


def test_an_oversized_template_is_refused():
    with pytest.raises(SpecCompileError, match="over the 1,048,576 a template may be"):
        render_chat("x" * (2 << 20), {}, [{"role": "user", "content": "x"}])
