"""Chat templates render exactly as transformers' apply_chat_template renders them, from a model
folder's tokenizer_config.json or chat_template.jinja, and a rendered prompt gets one BOS."""
from __future__ import annotations

import json

import pytest
import transformers
from test_hf_folder import _train_tokenizer

from pdserve.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from pdserve.errors import ConfigError
from pdserve.tokenizer import HFTokenizer, TokenizerConfig

# Three shapes real models use: ChatML with a default system prompt, Llama 3's headers with
# bos_token and trim, and an [INST] template that checks alternation with raise_exception and
# uses namespace, loop controls, a {% generation %} block and tojson.
CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA3 = """{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + \
message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}\
{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""
INST = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% if (message['role'] == 'user') != (ns.turns % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% else %}
        {% generation %}{{ message['content'] + eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}
{{ {"turns": ns.turns, "note": "é"} | tojson }}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Café?"}],
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def _hf(template: str) -> transformers.PreTrainedTokenizerFast:
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), **SPECIAL)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [CHATML, LLAMA3, INST], ids=["chatml", "llama3", "inst"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one", "four"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_as_transformers_renders(template, conversation, add_generation_prompt):
    expected = _hf(template).apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
    ours = ChatTemplate(template, SPECIAL).render(conversation,
                                                  add_generation_prompt=add_generation_prompt)
    assert ours == expected


def test_raise_exception_refuses_the_messages_as_a_bad_request():
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="alternate"):
        _hf(INST).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="alternate"):
        ChatTemplate(INST, SPECIAL).render(bad)


def test_a_folder_template_and_its_special_tokens_as_transformers_loads_them(tmp_path):
    tok = _hf(LLAMA3)
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    template = load_chat_template("", str(tmp_path))
    assert template is not None
    for conversation in CONVERSATIONS:
        assert template.render(conversation) == loaded.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)


def test_chat_template_jinja_and_the_flag_override_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": {"content": "<s>", "special": True}}))
    assert TokenizerConfig.of_folder(tmp_path).special_tokens == {"bos_token": "<s>"}
    assert load_chat_template("", str(tmp_path)).source == CHATML
    (tmp_path / "chat_template.jinja").write_text(LLAMA3)
    assert load_chat_template("", str(tmp_path)).source == LLAMA3
    override = tmp_path / "mine.jinja"
    override.write_text(INST)
    assert load_chat_template(str(override), str(tmp_path)).source == INST


def test_a_broken_or_missing_template_is_one_line(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for x in %}")
    with pytest.raises(ConfigError, match="broken.jinja"):
        load_chat_template(str(broken), "tiny")
    with pytest.raises(ConfigError, match="nope.jinja"):
        load_chat_template(str(tmp_path / "nope.jinja"), "tiny")
    assert load_chat_template("", str(tmp_path)) is None   # a folder without one
    assert load_chat_template("", "tiny") is not None      # presets get ChatML's shape


def test_a_prompt_that_starts_with_bos_gets_no_second_one(tmp_path):
    _train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json", bos_token="<s>")
    assert tok.encode("hello")[0] == 0 and tok.encode("hello")[1] != 0
    rendered = ChatTemplate(LLAMA3, SPECIAL).render(CONVERSATIONS[0])
    for ids in (tok.encode(rendered), tok.encode(rendered, add_special_tokens=False)):
        assert ids[0] == 0 and 0 not in ids[1:]
