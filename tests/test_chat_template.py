"""``kvmove/serve/chat_template.py`` against ``transformers``' own ``apply_chat_template``
(issue 20): the same text and the same token ids for a checkpoint's template, the same
refusals; the fallback without one; then ``/v1/chat/completions`` of a real server on a
checkpoint with a template.

The reference is ``transformers.AutoTokenizer`` loaded offline from a small byte-level BPE
tokenizer and a template this test writes (``helpers/hf_checkpoint.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmove.engine.tokenizer import HFTokenizer
from kvmove.serve.chat_template import FALLBACK_TEMPLATE, TemplateError, load_chat_template

from helpers.hf_checkpoint import write_bpe_tokenizer, write_checkpoint
from helpers.serve import Server

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 2's: BOS written by the template, system folded into the first user turn, roles
# that must alternate (raise_exception otherwise)
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
          "{% set system_message = messages[0]['content'] %}{% else %}"
          "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
          "{% for message in loop_messages %}{% if (message['role'] == 'user') != "
          "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and "
          "system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}"
          "{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
          "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] "
          "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
# Block tags on their own lines (trim_blocks, lstrip_blocks), tojson, a generation block
BLOCKS = """{%- for message in messages %}
    {%- if message.role == 'system' %}
<<{{ message.content | tojson }}>>
    {%- else %}
{{ bos_token }}{{ message.role }}: {% generation %}{{ message.content }}{% endgeneration %}
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}assistant:{% endif %}"""
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "blocks": BLOCKS}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "hello there"}],
    "system-user": [{"role": "system", "content": "you are terse. <b>\"quoted\"</b>"},
                    {"role": "user", "content": "héllo wörld ✓ 🦙"}],
    "turns": [{"role": "user", "content": " the kv cache "},
              {"role": "assistant", "content": "moves fast"},
              {"role": "user", "content": "between workers?"}],
}


def _reference(path: str) -> object:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _ids(encoding: object) -> list[int]:
    return list(encoding["input_ids"] if not isinstance(encoding, list) else encoding)


@pytest.mark.parametrize("conversation", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["generation", "plain"])
def test_chat_template_renders_as_transformers_does(tmp_path: Path, name: str,
                                                    conversation: list[dict],
                                                    add_generation_prompt: bool) -> None:
    write_bpe_tokenizer(str(tmp_path), TEMPLATES[name])
    reference = _reference(str(tmp_path))
    template = load_chat_template(str(tmp_path))
    text = template.render(conversation, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = HFTokenizer(str(tmp_path)).encode(text, add_bos=template.add_bos)
    assert ids == _ids(reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt))
    assert not template.add_bos


def test_a_template_that_writes_bos_is_not_given_another(tmp_path: Path) -> None:
    write_bpe_tokenizer(str(tmp_path), LLAMA2)
    tokenizer = HFTokenizer(str(tmp_path))
    template = load_chat_template(str(tmp_path))
    ids = tokenizer.encode(template.render(CONVERSATIONS["user"]), add_bos=template.add_bos)
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id


def test_raise_exception_refuses_the_conversation_as_transformers_does(tmp_path: Path) -> None:
    import jinja2

    write_bpe_tokenizer(str(tmp_path), LLAMA2)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        _reference(str(tmp_path)).apply_chat_template(bad, tokenize=False)
    with pytest.raises(TemplateError, match="refused the conversation: Conversation roles "
                                            "must alternate"):
        load_chat_template(str(tmp_path)).render(bad)


def test_chat_template_jinja_file_comes_first(tmp_path: Path) -> None:
    write_bpe_tokenizer(str(tmp_path), CHATML)
    (tmp_path / "chat_template.jinja").write_text(BLOCKS)
    conversation = CONVERSATIONS["turns"]
    template = load_chat_template(str(tmp_path))
    assert template.origin == os.path.join(str(tmp_path), "chat_template.jinja")
    assert template.render(conversation) == _reference(str(tmp_path)).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)


def test_a_list_of_named_templates_uses_the_default(tmp_path: Path) -> None:
    write_bpe_tokenizer(str(tmp_path), [{"name": "tool_use", "template": BLOCKS},
                                        {"name": "default", "template": CHATML}])
    assert load_chat_template(str(tmp_path)).source == CHATML


def test_without_a_template_the_fallback_is_used_and_bos_added(tmp_path: Path) -> None:
    write_bpe_tokenizer(str(tmp_path))  # no chat_template
    for template in (load_chat_template(str(tmp_path)), load_chat_template(None)):
        assert (template.source, template.origin, template.add_bos) == (
            FALLBACK_TEMPLATE, "fallback", True)
        text = template.render([{"role": "system", "content": "be terse"},
                                {"role": "user", "content": "hi"}])
        assert text == "<|system|>\nbe terse\n<|user|>\nhi\n<|assistant|>\n"


def test_a_template_that_does_not_compile_is_a_config_error(tmp_path: Path) -> None:
    from kvmove.errors import ConfigError

    write_bpe_tokenizer(str(tmp_path), "{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile"):
        load_chat_template(str(tmp_path))


def test_a_template_cannot_reach_python_internals(tmp_path: Path) -> None:
    """The sandbox: a checkpoint's template is code from elsewhere."""
    write_bpe_tokenizer(str(tmp_path), "{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        load_chat_template(str(tmp_path)).render(CONVERSATIONS["user"])


# --- a server on a checkpoint with a template -------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    pytest.importorskip("tokenizers")
    path = str(tmp_path_factory.mktemp("chat-model"))
    write_checkpoint(path, LLAMA2)
    server = Server("--model", path, "--mode", "colocated", "--workers", "1", "--no-restart")
    yield server, path
    server.close()


def test_chat_completions_use_the_checkpoints_template(
        checkpoint_server: tuple[Server, str]) -> None:
    server, path = checkpoint_server
    name = os.path.basename(path)
    conversation = CONVERSATIONS["system-user"]
    expected = _ids(_reference(path).apply_chat_template(conversation, tokenize=True,
                                                         add_generation_prompt=True))
    result = server.client().chat.completions.create(model=name, messages=conversation,
                                                     max_tokens=4, temperature=0)
    assert result.usage.prompt_tokens == len(expected)


def test_a_conversation_the_template_refuses_is_400(
        checkpoint_server: tuple[Server, str]) -> None:
    import openai

    server, path = checkpoint_server
    bad = [{"role": "assistant", "content": "I go first"}]
    with pytest.raises(openai.BadRequestError) as error:
        server.client().chat.completions.create(model=os.path.basename(path), messages=bad,
                                                max_tokens=2)
    assert error.value.param == "messages"
    assert "Conversation roles must alternate" in str(error.value)
