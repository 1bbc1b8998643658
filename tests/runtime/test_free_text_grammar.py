"""Tool-call grammars whose value is text, not JSON (custom tools), checked token by token
against the real model's vocabulary: Codex CLI's own apply_patch grammar, any text ended by the
closing tag, a regex with slashes and line breaks, and grammars that cannot be used."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from skippy_cache.runtime.gguf_info import default_model_path
from skippy_cache.runtime.native import GRAMMAR_LIMITS, FreeText, NativeModel, literal_json_grammar

pytestmark = [pytest.mark.model]

#: Codex CLI's apply_patch tool format, as it sends it (codex-rs `apply_patch.lark`).
CODEX_APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
PATCH = "*** Begin Patch\n*** Update File: src/app.py\n@@ def main():\n-    print('hi')\n+    print('hello')\n*** End Patch"


@pytest.fixture(scope="module")
def model() -> NativeModel:
    return NativeModel(default_model_path(), use_extra_bufts=False)


def takes(model: NativeModel, grammar: str, text: str) -> bool:
    """The grammar allows `text`, token by token, and may end after it."""
    matcher = LLMatcher(model.grammar_tokenizer, grammar, limits=GRAMMAR_LIMITS, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = model.tokenize(text, add_special=False, parse_special=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) \
        and matcher.is_accepting()


def call(name: str, value: FreeText) -> tuple[str, str, FreeText, str]:
    return (name, f'{OPEN}{{"name": "{name}"}}\n', value, CLOSE)


def test_codexs_apply_patch_grammar_holds_the_call_to_a_patch(model: NativeModel) -> None:
    grammar = literal_json_grammar([call("apply_patch", FreeText("lark", CODEX_APPLY_PATCH)),
                                    ("f", f'{OPEN}{{"name": "f", "arguments": ', {"type": "object"}, "}" + CLOSE)],
                                   repeat_with=None)
    head = f'{OPEN}{{"name": "apply_patch"}}\n'
    assert takes(model, grammar, head + PATCH + CLOSE)
    assert takes(model, grammar, head + PATCH + "\n" + CLOSE)  # its optional last line break
    assert not takes(model, grammar, head + PATCH.replace("*** Update", "*** Change") + CLOSE)
    assert not takes(model, grammar, head + PATCH)  # the call is not closed
    assert takes(model, grammar, f'{OPEN}{{"name": "f", "arguments": {{"a": 1}}}}{CLOSE}')


def test_any_text_ends_at_the_closing_tag_and_calls_repeat(model: NativeModel) -> None:
    grammar = literal_json_grammar([call("note", FreeText("text"))], repeat_with="\n")
    one = f'{OPEN}{{"name": "note"}}\nany {{text}}, "quoted"\nand lines{CLOSE}'
    assert takes(model, grammar, one)
    assert takes(model, grammar, one + "\n" + one)
    assert not takes(model, grammar, one + "trailing")


def test_a_regex_with_slashes_and_line_breaks_is_taken_as_written(model: NativeModel) -> None:
    grammar = literal_json_grammar([call("path", FreeText("regex", "/[a-z]+(/[a-z]+)*\n[0-9]+\\/"))],
                                   repeat_with=None)
    head = f'{OPEN}{{"name": "path"}}\n'
    assert takes(model, grammar, head + "/usr/local\n42/" + CLOSE)
    assert not takes(model, grammar, head + "usr\n42/" + CLOSE)


@pytest.mark.parametrize(("value", "message"), [
    (FreeText("lark", "start: ("), "lark grammar cannot be used"),
    (FreeText("lark", "start: undefined_rule"), "lark grammar cannot be used"),
    (FreeText("lark", "start: @text0"), "lark grammar cannot be used"),
    (FreeText("regex", "(unclosed"), "regex grammar cannot be used"),
    (FreeText("ebnf", "x"), "'ebnf' is not supported"),
], ids=["lark-syntax", "lark-undefined", "lark-own-reference", "regex-syntax", "other-syntax"])
def test_a_grammar_that_cannot_be_used_is_a_value_error_led_by_its_label(value: FreeText, message: str) -> None:
    with pytest.raises(ValueError, match=f"^the tool: .*{message}"):
        literal_json_grammar([("the tool", "x", value, "y")], repeat_with=None)
