"""A conversation as the prompt text its model was trained on: the checkpoint's chat template.

The rule is ``transformers``' (``apply_chat_template``), so a checkpoint's chats read the same
here as there:

* the template: ``chat_template.jinja`` beside the tokenizer, else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or a list of ``{"name", "template"}``: the one named
  ``default``);
* rendered with jinja2 in an immutable sandbox (a template is code from the checkpoint), with
  ``trim_blocks`` and ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``
  (true: the text ends where the assistant's answer starts), ``tools`` and ``documents``
  (None), the special tokens' text (``bos_token``, ``eos_token``, ...), and the helpers
  ``raise_exception`` (the template refuses the conversation: a 400), ``strftime_now`` and a
  ``tojson`` that does not escape HTML;
* the text is tokenized **without** adding BOS: the template writes ``bos_token`` where the
  model wants it (adding one more would double it).

Without a template (the presets' byte tokenizer; a checkpoint that has none) the fallback is
``FALLBACK_TEMPLATE``: each message as ``<|role|>``, a newline, its content and a newline,
then ``<|assistant|>`` and a newline; BOS is added by the tokenizer, as for a completion.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvmove.engine.tokenizer import tokenizer_config
from kvmove.errors import ConfigError

__all__ = ["FALLBACK_TEMPLATE", "ChatTemplate", "TemplateError", "load_chat_template"]

FALLBACK_TEMPLATE = ("{% for message in messages %}<|{{ message.role }}|>\n"
                     "{{ message.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class TemplateError(ConfigError):
    """The template refused the conversation (``raise_exception``) or failed rendering it."""


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template.

    Attributes:
        source: the jinja text.
        origin: where it came from (a file, or ``"fallback"``).
        add_bos: whether the tokenizer adds BOS to the rendered text (the fallback only).
        specials: the special tokens' text, as template variables.
    """

    source: str
    origin: str
    add_bos: bool = False
    specials: dict[str, str] = field(default_factory=dict)
    _compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _compile(self.source, self.origin))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``).

        Raises:
            TemplateError: the template refused the conversation or failed on it.
        """
        import jinja2

        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.specials)
        except jinja2.TemplateError as error:
            raise TemplateError(f"the chat template ({self.origin}) refused the "
                                f"conversation: {error}") from None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile(source: str, origin: str) -> Any:
    """The template compiled as ``transformers`` compiles it (a ``{% generation %}`` block,
    which marks the assistant's part for training masks, renders its body)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise ConfigError(f"the chat template of {origin} does not compile: {error}") from None


def load_chat_template(tokenizer_dir: str | None) -> ChatTemplate:
    """The chat template of the tokenizer in ``tokenizer_dir`` (None: no files, as the
    presets' byte tokenizer), or the fallback.

    Raises:
        ConfigError: jinja2 is not installed, or the template does not compile.
    """
    try:
        import jinja2  # noqa: F401
    except ImportError as error:
        raise ConfigError("chat templates need jinja2: pip install 'kvmove[serve]'") from error
    if tokenizer_dir is None:
        return ChatTemplate(FALLBACK_TEMPLATE, "fallback", add_bos=True)
    config = tokenizer_config(tokenizer_dir)
    specials = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k)}
    jinja_file = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            return ChatTemplate(f.read(), jinja_file, specials=specials)
    source = _named_template(config.get("chat_template"))
    if source is None:
        return ChatTemplate(FALLBACK_TEMPLATE, "fallback", add_bos=True)
    return ChatTemplate(source, os.path.join(tokenizer_dir, "tokenizer_config.json"),
                        specials=specials)


def _token_text(token: Any) -> str:
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _named_template(value: Any) -> str | None:
    if isinstance(value, list):  # several named templates: the default one
        value = next((t.get("template") for t in value
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) and value else None
