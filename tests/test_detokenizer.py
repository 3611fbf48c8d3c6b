"""``kvmove/engine/detokenizer.py`` and the tokenizers' incremental decoders
(``decode_stream``), against the whole-output decode they replace.

The reference for text: ``tokenizer.decode(ids)``. The reference for stop strings: decode the
output again after every token and cut it before the first stop string, as the engine and the
router did; the incremental ``Detokenizer`` must give the same text, stop at the same token,
and never release a character that the reference would cut. Then the reason it exists:
bounded work a token, counted (decoder steps, full decodes, text held), never timed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmove.engine.detokenizer import Detokenizer
from kvmove.engine.tokenizer import ByteTokenizer, HFTokenizer
from kvmove.errors import ConfigError

from helpers.hf_checkpoint import write_bpe_tokenizer

BYTES = ByteTokenizer()
# bytes (UTF-8 lead and continuation bytes, invalid ones), BOS/EOS and ids past the bytes
BYTE_IDS = st.lists(st.one_of(st.integers(0, 255), st.sampled_from([0xE2, 0x82, 0xAC, 0xF0,
                                                                    0x9F, 0xA6, 0x99, 0xC3,
                                                                    0xA9, 256, 257, 300])),
                    max_size=60)
STOPS = st.lists(st.text(st.sampled_from("abc€é"), min_size=1, max_size=4), max_size=4)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    pytest.importorskip("tokenizers")
    path = str(tmp_path_factory.mktemp("bpe"))
    write_bpe_tokenizer(path)
    return HFTokenizer(path)


def _stream_text(tokenizer: object, ids: list[int]) -> str:
    stream = tokenizer.decode_stream()
    return "".join(stream.step(i) for i in ids) + stream.flush()


def _reference(tokenizer: object, ids: list[int], stop: list[str]) -> tuple[str, int | None]:
    """(text, the number of tokens after which a stop string showed) the way the engine did
    it before: the whole output decoded again after every token."""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k])
        found = [i for i in (text.find(s) for s in stop) if i >= 0]
        if found:
            return text[:min(found)], k
    return tokenizer.decode(ids), None


# --- incremental decoding ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(BYTE_IDS)
def test_byte_stream_equals_decode(ids: list[int]) -> None:
    assert _stream_text(BYTES, ids) == BYTES.decode(ids)


def test_byte_stream_releases_a_character_with_its_last_byte() -> None:
    stream = BYTES.decode_stream()
    assert [stream.step(b) for b in "a€".encode()] == ["a", "", "", "€"]
    assert [stream.step(b) for b in "🦙".encode()[:3]] == ["", "", ""]
    assert stream.flush() == "\ufffd"  # as decode() says of a character cut short


def test_byte_stream_rejects_a_negative_id() -> None:
    with pytest.raises(ConfigError, match="token ids must be >= 0, got -1"):
        BYTES.decode_stream().step(-1)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40))
def test_hf_stream_equals_decode(bpe: HFTokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert _stream_text(bpe, ids) == bpe.decode(ids) == text


def test_hf_stream_skips_ids_past_the_vocabulary_and_flushes_a_cut_character(
        bpe: HFTokenizer) -> None:
    ids = bpe.encode("ok 🦙", add_bos=False)
    cut = ids[:-1]  # the llama's last byte missing
    assert _stream_text(bpe, [*cut, bpe.vocab_size + 5]) == bpe.decode(cut)
    assert bpe.decode(cut).endswith("\ufffd")


# --- stop strings ------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(list("abc") + ["€", "é", "ab", "bc"]), max_size=40), STOPS)
def test_stop_strings_end_the_text_where_decoding_everything_again_did(
        pieces: list[str], stop: list[str]) -> None:
    ids = list("".join(pieces).encode())  # multi-byte characters arrive a byte at a time
    expected, stopped_at = _reference(BYTES, ids, stop)
    texts = Detokenizer(BYTES, stop)
    released = ""
    for k, token in enumerate(ids, 1):
        released += texts.push(token)
        assert expected.startswith(released), "released text the reference cuts"
        if texts.stopped:
            assert k == stopped_at
            break
    else:
        assert stopped_at is None
        released += texts.flush()
    assert released == texts.text == expected


def test_text_that_may_begin_a_stop_string_is_held_until_settled() -> None:
    texts = Detokenizer(BYTES, ["</s>"])
    assert [texts.push(b) for b in b"a </"] == ["a", " ", "", ""]
    assert texts.held == "</"
    assert texts.push(ord(">")) == "</>"  # "</>" cannot become "</s>": released
    assert [texts.push(b) for b in b"</s"] == ["", "", ""]
    assert texts.push(ord(">")) == "" and texts.stopped
    assert texts.push(ord("x")) == "" and texts.flush() == ""
    assert texts.text == "a </>"


def test_flush_releases_what_was_held() -> None:
    texts = Detokenizer(BYTES, ["xyz"])
    assert [texts.push(b) for b in b"abxy"] == ["a", "b", "", ""]
    assert texts.flush() == "xy" and texts.text == "abxy" and not texts.stopped


def test_engine_and_detokenizer_agree_on_a_bpe_stop(bpe: HFTokenizer) -> None:
    ids = bpe.encode("the kv cache moves fast", add_bos=False)
    expected, k = _reference(bpe, ids, ["cache"])
    texts = Detokenizer(bpe, ["cache"])
    released = "".join(texts.push(i) for i in ids[:k])
    assert texts.stopped and released == expected == "the kv "


# --- bounded work a token ------------------------------------------------------------------


class CountingTokenizer:
    """The byte tokenizer, counting what decoding costs: ids through ``decode`` (the whole
    output again, each time) and steps of the incremental decoder."""

    def __init__(self) -> None:
        self.decoded_ids = 0
        self.steps = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded_ids += len(ids)
        return BYTES.decode(ids)

    def decode_stream(self) -> object:
        counter, stream = self, BYTES.decode_stream()

        class Counted:
            def step(self, token: int) -> str:
                counter.steps += 1
                return stream.step(token)

            def flush(self) -> str:
                return stream.flush()

        return Counted()


def test_finding_9_detokenizer_does_bounded_work_per_token() -> None:
    """Issue 15 #9: a 2,000-token output with 16 stop strings of 256 characters (the API's
    limits) that keep almost matching. Each token is one decoder step, nothing is decoded
    twice, and the text searched for stop strings (what is held back plus the new text)
    never outgrows the longest stop string: the work a token does does not grow with the
    output."""
    tokenizer = CountingTokenizer()
    stop = ["ab" * 127 + f"{i:02d}" for i in range(16)]
    texts = Detokenizer(tokenizer, stop)
    ids = list(b"ab" * 1000)
    most_held = 0
    for token in ids:
        texts.push(token)
        most_held = max(most_held, len(texts.held))
    texts.flush()
    assert tokenizer.steps == len(ids)
    assert tokenizer.decoded_ids == 0
    assert most_held <= 255  # the longest stop string less one character
    assert texts.text == "ab" * 1000 and not texts.stopped

