# ruff: noqa: E501  (chat templates are data: their lines are kept whole, as such templates are written)
"""Chat templates rendered as transformers renders them: for templates in the style of each supported
family (the Jinja features they rely on: loop controls, raise_exception, namespace, tojson, strftime_now,
bos_token and other special tokens, system-prompt folding, enable_thinking), our string for the same
conversation equals `AutoTokenizer.apply_chat_template(..., tokenize=False)` on the same directory.
The templates are written for this test in each family's turn format."""

from __future__ import annotations

import json

import pytest

from tests.arch_helpers import write_tokenizer
from tokenizer import tokenizer_from_hf_dir

TEMPLATES = {
    "gemma3": """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns -%}
    {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception('roles must alternate') }}{%- endif -%}
    {{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + (prefix if loop.first else '') }}
    {{- m['content'] | trim }}{{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}""",
    "qwen3": """{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}
{{- '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_user=messages|length - 1) %}
{%- for m in messages[::-1] %}{%- if m.role == 'user' %}{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- break %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'assistant' and loop.index0 < ns.last_user %}{%- continue %}{%- endif %}
    {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}""",
    "phi3": """{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'user' %}{{'<|user|>
' + message['content'] + '<|end|>
'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>
' + message['content'] + '<|end|>
'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>
' }}{% else %}{{ eos_token }}{% endif %}""",
    "llama3": """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '<|eot_id|>' }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}""",
    "mistral": """{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system is defined %}{{- '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}
    {%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}
    {%- else %}{{- raise_exception('Only user and assistant roles are supported') }}{%- endif %}
{%- endfor %}""",
}
SPECIAL = {"gemma3": dict(bos_token="<bos>", eos_token="<eos>"), "qwen3": dict(eos_token="<|im_end|>"),
           "phi3": dict(bos_token="<s>", eos_token="<|endoftext|>"),
           "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
           "mistral": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  What is 2+2? "},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3 — in Ελληνικά?"}],
]


def load_both(tmp_path, family: str, in_config: bool = False):
    import transformers

    write_tokenizer(tmp_path, TEMPLATES[family], **SPECIAL[family])
    if in_config:  # the older layout: the template inside tokenizer_config.json
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config["chat_template"] = (tmp_path / "chat_template.jinja").read_text()
        (tmp_path / "chat_template.jinja").unlink()
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer_from_hf_dir(tmp_path, {}), transformers.AutoTokenizer.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("family", list(TEMPLATES))
@pytest.mark.parametrize("in_config", [False, True])
def test_rendering_matches_transformers(tmp_path, family, in_config):
    ours, reference = load_both(tmp_path, family, in_config)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render_chat(messages, add_generation_prompt=gen) == expected
    assert ours.apply_chat_template("Hi there") == reference.apply_chat_template(
        CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)


def test_template_variables_and_tools_match_transformers(tmp_path):
    ours, reference = load_both(tmp_path, "qwen3")
    messages = CONVERSATIONS[1]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
    assert ours.render_chat(messages, enable_thinking=False) == expected
    assert expected.endswith("<think>\n\n</think>\n\n")
    tools = [{"type": "function", "function": {"name": "f", "description": "café <b>", "parameters": {}}}]
    expected = reference.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, tools=tools) == expected and "café <b>" in expected


def test_template_errors_are_one_line_user_errors(tmp_path):
    from errors import UserError

    ours, _ = load_both(tmp_path, "mistral")
    with pytest.raises(UserError, match="Only user and assistant"):
        ours.render_chat([{"role": "tool", "content": "x"}])
