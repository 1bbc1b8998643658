from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.runtime.textstream import TextStream


def test_multibyte_character_split_across_tokens():
    stream = TextStream()
    parts = [stream.push(b"caf"), stream.push(b"\xc3"), stream.push(b"\xa9 \xf0\x9f"), stream.push(b"\x98\x80")]
    assert [p.text for p in parts] == ["caf", "", "é ", "😀"]


def test_stop_string_spanning_tokens_is_never_released():
    stream = TextStream(stop=["</end>"])
    released = [stream.push(p).text for p in [b"hello </", b"en", b"d> tail"]]
    assert "".join(released) == "hello "
    assert stream.stopped_on == "</end>"


def test_held_back_prefix_is_released_when_it_cannot_be_a_stop():
    stream = TextStream(stop=["STOP"])
    assert stream.push(b"ab ST").text == "ab "
    assert stream.push(b"AR").text == "STAR"


@given(st.text(min_size=1, max_size=60), st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_streamed_text_equals_decoded_whole(text, cuts):
    data = text.encode("utf-8")
    stream = TextStream()
    out, i = [], 0
    for size in cuts * 20:
        if i >= len(data):
            break
        out.append(stream.push(data[i : i + size]).text)
        i += size
    out.append(stream.push(data[i:]).text)
    out.append(stream.finish().text)
    assert "".join(out) == text
