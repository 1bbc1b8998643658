"""Chat templates render as transformers' apply_chat_template does, or as llama.cpp's built-ins do;
which one is chosen (no model needed)."""

from __future__ import annotations

import pytest
from chat_templates import SMOLLM2

from skippy_cache.runtime import builtin_chat_templates
from skippy_cache.server.chat import (
    BUILTIN_BY_ARCHITECTURE,
    CHATML_TEMPLATE,
    ChatFormatter,
    ChatTemplateError,
    choose_chat_template,
)
from skippy_cache.server.schemas import ChatCompletionRequest, ChatMessage
from skippy_cache.server.settings import SettingsError, load_settings


def messages(*pairs: tuple[str, object]) -> list[ChatMessage]:
    body = {"messages": [{"role": r, "content": c} for r, c in pairs]}
    return ChatCompletionRequest.model_validate(body).messages


def test_smollm2_template() -> None:
    chat = ChatFormatter(choose_chat_template(None, SMOLLM2, "llama"), bos_token="<|im_start|>", eos_token="<|im_end|>")
    text = chat.render(messages(("user", "Hi")))
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.template.origin == "GGUF tokenizer.chat_template"


def test_text_parts_and_developer_role() -> None:
    chat = ChatFormatter(choose_chat_template(None, SMOLLM2, "llama"), bos_token="", eos_token="")
    text = chat.render(messages(("developer", "Be brief."), ("user", [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}])))
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text
    assert "<|im_start|>user\na\nb<|im_end|>" in text


def test_bos_token_and_trim_blocks() -> None:
    template = "{{ bos_token }}\n{% for m in messages %}\n[{{ m.role }}] {{ m.content }}\n{% endfor %}\n"
    chat = ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="<s>", eos_token="</s>")
    text = chat.render(messages(("user", "x")))
    assert text == "<s>\n[user] x\n"  # trim_blocks drops the newline after each block tag
    assert chat.starts_with_bos(text)
    assert not ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="", eos_token="").starts_with_bos("[user] x")


def test_raise_exception_becomes_a_template_error() -> None:
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}"
    )
    chat = ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        chat.render(messages(("assistant", "x")))


def test_tojson_keeps_non_ascii_and_generation_tag_renders_its_body() -> None:
    template = (
        "{% for m in messages %}{{ m.content | tojson }}{% generation %}!{% endgeneration %}{% endfor %}"
    )
    chat = ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="", eos_token="")
    assert chat.render(messages(("user", "héllo <b>"))) == '"héllo <b>"!'


def test_sandbox_blocks_attribute_escapes() -> None:
    template = "{{ messages.__class__.__mro__ }}"
    chat = ChatFormatter(choose_chat_template(None, template, "llama"), bos_token="", eos_token="")
    with pytest.raises(ChatTemplateError):
        chat.render(messages(("user", "x")))


def test_no_template_falls_back_to_chatml() -> None:
    chat = ChatFormatter(choose_chat_template(None, None, "llama"), bos_token="", eos_token="")
    assert chat.template.jinja == CHATML_TEMPLATE
    assert chat.render(messages(("user", "Hi"))) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_broken_template_falls_back_to_chatml() -> None:
    chat = ChatFormatter(choose_chat_template(None, "{% for %}", "llama"), bos_token="", eos_token="")
    assert chat.template.jinja == CHATML_TEMPLATE and "does not compile" in chat.template.origin


def test_the_template_is_the_setting_then_the_ggufs_then_the_architectures_then_chatml(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert choose_chat_template(path, SMOLLM2, "gemma3").jinja == "{{ messages[0]['content'] }}"
    named = choose_chat_template("llama3", SMOLLM2, "gemma3")
    assert (named.builtin, named.origin) == ("llama3", "llama.cpp built-in 'llama3' (--chat-template)")
    assert choose_chat_template(None, SMOLLM2, "gemma3").jinja == SMOLLM2
    # A GGUF without a template: the built-in its architecture was trained on, said so.
    gemma = choose_chat_template(None, None, "gemma3")
    assert gemma.builtin == "gemma" and "for architecture gemma3" in gemma.origin
    # An architecture with no one format (a "llama" GGUF may be Llama 2, 3 or Mistral): ChatML.
    plain = choose_chat_template(None, None, "llama")
    assert plain.jinja == CHATML_TEMPLATE and "no built-in for architecture llama" in plain.origin


def test_every_architecture_maps_to_a_builtin_llama_cpp_has() -> None:
    assert set(BUILTIN_BY_ARCHITECTURE.values()) <= set(builtin_chat_templates())


def test_a_builtin_template_renders_as_llama_cpp_does() -> None:
    chat = ChatFormatter(choose_chat_template("gemma", None, "llama"), bos_token="<bos>", eos_token="<eos>")
    text = chat.render(messages(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Why?")))
    # Gemma has no system role: llama.cpp folds the system message into the first user turn.
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n")
    # A longer history renders the shorter one as its prefix, up to the open assistant turn, as the
    # cache needs to reuse a turn's prompt and reply.
    shorter = chat.render(messages(("user", "Hi")))
    longer = chat.render(messages(("user", "Hi"), ("assistant", "Hello"), ("user", "Why?")))
    assert longer.startswith(shorter)


def test_a_chat_template_setting_is_a_file_or_a_builtin_name(tmp_path) -> None:
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_settings(env={"SKIPPY_CHAT_TEMPLATE": str(good)}).chat_template == good
    assert load_settings(env={"SKIPPY_CHAT_TEMPLATE": "chatml"}).chat_template == "chatml"
    with pytest.raises(SettingsError, match="neither a Jinja file nor one of llama.cpp's built-in templates"):
        load_settings(env={"SKIPPY_CHAT_TEMPLATE": "gemmaa"})
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(SettingsError, match="not a Jinja template"):
        load_settings(env={"SKIPPY_CHAT_TEMPLATE": str(bad)})


#: Gemma's rule, cut down: roles alternate user, model, user, ..., and a system message may only
#: open the conversation (it joins the first user turn).
ALTERNATING = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Roles must alternate') }}{% endif %}"
    "<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
    "{% endfor %}<assistant>"
)


def test_a_later_system_message_is_a_system_turn_where_the_template_takes_one() -> None:
    chat = ChatFormatter(choose_chat_template(None, SMOLLM2, "llama"), bos_token="", eos_token="")
    assert chat.caps.late_system
    text = chat.render(messages(("user", "Hi"), ("system", "Skills: none."), ("assistant", "Hello"), ("user", "Go")))
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nSkills: none.<|im_end|>\n" in text


@pytest.mark.parametrize("lead", [(), (("system", "Be brief."),)], ids=["no-system", "system-first"])
def test_a_later_system_message_ends_the_user_turn_before_it_where_the_template_takes_none(lead) -> None:
    chat = ChatFormatter(choose_chat_template(None, ALTERNATING, "gemma3"), bos_token="", eos_token="")
    assert not chat.caps.late_system and not chat.caps.system_role
    first = [*lead, ("user", "Hi"), ("system", "Skills: none.")]
    later = [*first, ("assistant", "Hello"), ("user", "Go"), ("system", "Reminder.")]
    one, two = chat.render(messages(*first)), chat.render(messages(*later))
    opening = "Be brief.\n\n" if lead else ""
    assert one == f"<user>{opening}Hi\n\nSkills: none.</user><assistant>"
    # The conversation grows after the system message: everything before renders as before.
    assert two.startswith(one.removesuffix("<assistant>"))
    assert two.endswith("<user>Go\n\nReminder.</user><assistant>")


def test_a_system_message_with_no_user_turn_before_it_opens_the_next() -> None:
    chat = ChatFormatter(choose_chat_template(None, ALTERNATING, "gemma3"), bos_token="", eos_token="")
    assert chat.render(messages(("system", "A"), ("system", "B"), ("user", "Hi"))) == "<user>A\n\nB\n\nHi</user><assistant>"
