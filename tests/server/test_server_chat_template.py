"""Chat templates render as transformers' apply_chat_template does (no model needed)."""

from __future__ import annotations

import pytest

from skippy_cache.server.chat import ChatFormatter, ChatTemplateError
from skippy_cache.server.schemas import ChatCompletionRequest, ChatMessage

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def messages(*pairs: tuple[str, object]) -> list[ChatMessage]:
    body = {"messages": [{"role": r, "content": c} for r, c in pairs]}
    return ChatCompletionRequest.model_validate(body).messages


def test_smollm2_template() -> None:
    chat = ChatFormatter(SMOLLM2, bos_token="<|im_start|>", eos_token="<|im_end|>")
    text = chat.render(messages(("user", "Hi")))
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.source == "gguf"


def test_text_parts_and_developer_role() -> None:
    chat = ChatFormatter(SMOLLM2, bos_token="", eos_token="")
    text = chat.render(messages(("developer", "Be brief."), ("user", [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}])))
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "<|im_start|>user\na\nb<|im_end|>" in text


def test_bos_token_and_trim_blocks() -> None:
    template = "{{ bos_token }}\n{% for m in messages %}\n[{{ m.role }}] {{ m.content }}\n{% endfor %}\n"
    chat = ChatFormatter(template, bos_token="<s>", eos_token="</s>")
    text = chat.render(messages(("user", "x")))
    assert text == "<s>\n[user] x\n"  # trim_blocks drops the newline after each block tag
    assert chat.starts_with_bos(text)
    assert not ChatFormatter(template, bos_token="", eos_token="").starts_with_bos("[user] x")


def test_raise_exception_becomes_a_template_error() -> None:
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    chat = ChatFormatter(template, bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        chat.render(messages(("assistant", "x")))


def test_tojson_keeps_non_ascii_and_generation_tag_renders_its_body() -> None:
    template = (
        "{% for m in messages %}{{ m.content | tojson }}{% generation %}!{% endgeneration %}{% endfor %}"
    )
    chat = ChatFormatter(template, bos_token="", eos_token="")
    assert chat.render(messages(("user", "héllo <b>"))) == '"héllo <b>"!'


def test_sandbox_blocks_attribute_escapes() -> None:
    template = "{{ messages.__class__.__mro__ }}"
    chat = ChatFormatter(template, bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError):
        chat.render(messages(("user", "x")))


def test_no_template_falls_back_to_chatml() -> None:
    chat = ChatFormatter(None, bos_token="", eos_token="")
    assert chat.source == "chatml-fallback"
    assert chat.render(messages(("user", "Hi"))) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_broken_template_falls_back_to_chatml() -> None:
    chat = ChatFormatter("{% for %}", bos_token="", eos_token="")
    assert chat.source == "chatml-fallback"
