"""Chat templates the server tests render with (no model needed)."""

from pathlib import Path

#: SmolLM2-135M-Instruct's `tokenizer.chat_template`, as its GGUF carries it.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Qwen 2.5 Instruct's template (as llama.cpp keeps it in models/templates): it renders tools,
#: calls and tool results itself, in the Hermes syntax server/tools.py parses. Its special
#: tokens are ChatML's, which SmolLM2's tokenizer has, so the real model can serve it too.
QWEN25_FILE = Path(__file__).parent / "templates" / "qwen2.5-instruct.jinja"
QWEN25 = QWEN25_FILE.read_text()
