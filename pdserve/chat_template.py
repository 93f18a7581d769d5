"""Chat templates: a model's Jinja template turns OpenAI-style messages into one prompt string,
rendered the way Hugging Face transformers renders it (`apply_chat_template`): a sandboxed
environment with trim_blocks/lstrip_blocks and loop controls, the `tojson` filter, the
`raise_exception` and `strftime_now` globals, the `{% generation %}` block, and the tokenizer's
special tokens (bos_token, eos_token, ...) as variables. The rendered text carries its own
special tokens: it is tokenized without adding any.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from pdserve.errors import InvalidRequest

# For presets (byte vocabulary, no template of their own): ChatML's shape, so chat works on the
# `tiny` model too.
PRESET_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


class ChatTemplateError(InvalidRequest):
    """The template refused the messages (raise_exception) or could not render them."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _generation_extension() -> type:
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for serving it renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_extension(), loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as err:
            raise ValueError(f"chat template: line {err.lineno}: {err.message}") from err
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_file(cls, path: str, special_tokens: dict[str, str] | None = None) -> ChatTemplate:
        return cls(Path(path).read_text(), special_tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt for ``messages``; ChatTemplateError if the template refuses them."""
        from jinja2.exceptions import TemplateError

        kwargs.setdefault("tools", None)      # as transformers passes them: defined, None
        kwargs.setdefault("documents", None)
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **kwargs)
        except TemplateError as err:
            raise ChatTemplateError(f"chat template: {err}") from err


def load_chat_template(override_file: str, model_folder: str) -> ChatTemplate | None:
    """``override_file`` (--chat-template) if given, else the model folder's template (with
    its special tokens), else, for a preset, PRESET_TEMPLATE; None for a folder without one.
    ConfigError (one line) for a missing or broken template."""
    from pdserve.errors import ConfigError
    from pdserve.tokenizer import TokenizerConfig

    folder = Path(model_folder)
    tokenizer_config = TokenizerConfig.of_folder(folder) if folder.is_dir() else TokenizerConfig()
    try:
        if override_file:
            return ChatTemplate.from_file(override_file, tokenizer_config.special_tokens)
        if tokenizer_config.chat_template:
            return ChatTemplate(tokenizer_config.chat_template, tokenizer_config.special_tokens)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--chat-template {override_file or model_folder}: "
                          f"{getattr(err, 'strerror', None) or err}") from err
    return None if folder.is_dir() else ChatTemplate(PRESET_TEMPLATE)
