"""Text <-> token ids for the engine: bytes for random-weight models, ``tokenizers`` for real
checkpoints.

Both tokenizers share one interface: ``encode(text, add_bos=True) -> list[int]``,
``decode(ids) -> str``, ``decode_stream()`` (the same text one token at a time, see
``IncrementalDecoder``), and ``bos_token_id``, ``eos_token_id``, ``vocab_size`` (the smallest
model vocabulary that holds every id the tokenizer can produce). ``load_tokenizer`` picks one
for a model and checks that it fits the model's vocabulary.

``ByteTokenizer`` exists so the engine runs offline with ``LlamaForCausalLM.random``: ids
0..255 are the UTF-8 bytes of the text, and the special tokens live above them (256 = BOS and
257 = EOS, as ``ModelConfig``'s defaults), so any vocabulary of 258 ids or more works.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from kvmove.errors import ConfigError

if TYPE_CHECKING:
    from kvmove.engine.model import ModelConfig

__all__ = ["ByteTokenizer", "HFTokenizer", "IncrementalDecoder", "Tokenizer", "load_tokenizer",
           "tokenizer_config"]

NUM_BYTES = 256


class IncrementalDecoder(Protocol):
    """A generation's text, one token at a time: the concatenation of every ``step`` and the
    final ``flush`` is ``decode(ids)``. Each step costs the same whatever came before (where
    decoding every prefix again costs O(n) a token). A character split across tokens comes
    out whole with its last token; ``flush`` gives what an unfinished one decodes to (U+FFFD),
    as ``decode`` does."""

    def step(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    @property
    def bos_token_id(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def decode_stream(self) -> IncrementalDecoder: ...


def _check_id(token: int) -> int:
    if token < 0:
        raise ConfigError(f"token ids must be >= 0, got {token}")
    return token


def _check_ids(ids: Iterable[int]) -> list[int]:
    out = [int(i) for i in ids]
    negative = [i for i in out if i < 0]
    if negative:
        raise ConfigError(f"token ids must be >= 0, got {negative[0]}")
    return out


class _Specials:
    """BOS and EOS ids, which both tokenizers keep in ``_bos`` / ``_eos``."""

    _bos: int
    _eos: int

    @property
    def bos_token_id(self) -> int:
        return self._bos

    @property
    def eos_token_id(self) -> int:
        return self._eos


class ByteTokenizer(_Specials):
    """One token per UTF-8 byte (ids 0..255); BOS and EOS above the bytes.

    Args:
        bos_token_id: prepended by ``encode``; at least 256.
        eos_token_id: what a generation stops on; at least 256 (may equal ``bos_token_id``).
    """

    def __init__(self, bos_token_id: int = 256, eos_token_id: int = 257) -> None:
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if isinstance(value, bool) or not isinstance(value, int) or value < NUM_BYTES:
                raise ConfigError(f"{name} must be an int >= {NUM_BYTES} (ids below are bytes), "
                                  f"got {value!r}")
        self._bos, self._eos = bos_token_id, eos_token_id

    @property
    def vocab_size(self) -> int:
        """The smallest vocabulary holding the bytes and both special ids."""
        return max(self._bos, self._eos) + 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """``text``'s UTF-8 bytes as ids, after ``bos_token_id`` when ``add_bos``."""
        ids = list(text.encode("utf-8"))
        return [self._bos, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of the byte ids in ``ids``; ids >= 256 (specials, or whatever else a
        random model's larger vocabulary holds) are skipped. Bytes that are not valid UTF-8
        (e.g. a multi-byte character cut short) decode to U+FFFD instead of raising.

        Raises:
            ConfigError: a negative id.
        """
        data = bytes(i for i in _check_ids(ids) if i < NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def decode_stream(self) -> IncrementalDecoder:
        """``decode``, one token at a time (an incremental UTF-8 decoder)."""
        return _ByteStream()

    def __repr__(self) -> str:
        return f"ByteTokenizer(bos_token_id={self._bos}, eos_token_id={self._eos})"


class HFTokenizer(_Specials):
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

    Special ids, in this order of precedence: ``tokenizer_config.json``'s ``bos_token`` /
    ``eos_token`` (strings or ``{"content": ...}``, resolved with the tokenizer's own
    vocabulary), then ``config.json``'s ``bos_token_id`` / ``eos_token_id`` (the first of a
    list), then the ``bos_token_id`` / ``eos_token_id`` arguments. The tokenizer's files come
    first because they describe the tokenizer itself; ``config.json`` describes the model
    and can disagree (Llama 3 instruct lists three EOS ids there).

    ``encode`` never lets the tokenizer's post-processor add special tokens: BOS is ours to
    add (``add_bos``), so a template that also adds one cannot double it.

    Args:
        path: a directory holding ``tokenizer.json``.
        bos_token_id, eos_token_id: fallbacks when neither JSON file names the token.

    Raises:
        ConfigError: ``tokenizers`` is not installed, ``tokenizer.json`` is missing or
            unreadable, or a special token is named nowhere or not in the vocabulary.
    """

    def __init__(self, path: str, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> None:
        self.path = path
        self._tok = _load_tokenizers_file(os.path.join(path, "tokenizer.json"))
        self._bos = self._special("bos", bos_token_id)
        self._eos = self._special("eos", eos_token_id)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max([*vocab.values(), self._bos, self._eos]) + 1

    @property
    def vocab_size(self) -> int:
        """Largest id the tokenizer or its special tokens use, plus one."""
        return self._vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self._bos, *ids] if add_bos else list(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with special tokens skipped (ids past the vocabulary too).

        Raises:
            ConfigError: a negative id.
        """
        return self._tok.decode(_check_ids(ids), skip_special_tokens=True)

    def decode_stream(self) -> IncrementalDecoder:
        """``decode``, one token at a time (the ``tokenizers`` library's ``DecodeStream``).

        Raises:
            ConfigError: the installed ``tokenizers`` has no ``DecodeStream`` (before 0.21).
        """
        return _HFStream(self._tok, self._vocab_size)

    def _special(self, kind: str, fallback: int | None) -> int:
        token = tokenizer_config(self.path).get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            token_id = self._tok.token_to_id(token)
            if token_id is None:
                raise ConfigError(f"{kind}_token {token!r} of {self.path!r}'s "
                                  f"tokenizer_config.json is not in tokenizer.json's vocabulary")
            return token_id
        token_id = _read_json(self.path, "config.json").get(f"{kind}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        token_id = fallback if token_id is None else token_id
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ConfigError(f"{self.path!r} names no {kind} token (tokenizer_config.json "
                              f"{kind}_token, config.json {kind}_token_id), got {token_id!r}")
        return token_id

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.path!r}, bos_token_id={self._bos}, "
                f"eos_token_id={self._eos}, vocab_size={self._vocab_size})")


class _ByteStream:
    """UTF-8 bytes in, text out: Python's incremental decoder, with ``decode``'s U+FFFD for
    bytes that are not UTF-8, and ids past the bytes (specials) skipped."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token: int) -> str:
        if _check_id(token) >= NUM_BYTES:
            return ""
        return self._utf8.decode(bytes((token,)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _HFStream:
    """``DecodeStream`` (special tokens skipped) plus the two things it lacks: ids past the
    vocabulary are skipped, as ``decode`` does, and ``flush`` decodes the ids it still holds
    (the start of a character that never finished) against the ids of the text before them,
    once, at the end."""

    def __init__(self, tok: Any, vocab_size: int) -> None:
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError as error:
            raise ConfigError("incremental decoding needs tokenizers >= 0.21 (DecodeStream): "
                              "pip install -U tokenizers") from error
        self._tok, self._vocab_size = tok, vocab_size
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []     # stepped since the last text came out
        self._context: list[int] = []  # the ids of that text

    def step(self, token: int) -> str:
        if _check_id(token) >= self._vocab_size:
            return ""
        text = self._stream.step(self._tok, token)
        if text is None:
            self._held.append(token)
            return ""
        self._context, self._held = [*self._held, token], []
        return text

    def flush(self) -> str:
        if not self._held:
            return ""
        before = self._tok.decode(self._context, skip_special_tokens=True)
        after = self._tok.decode(self._context + self._held, skip_special_tokens=True)
        self._held = []
        return after[len(before):]


def _load_tokenizers_file(file: str) -> Any:
    try:
        from tokenizers import Tokenizer as _Tokenizer
    except ImportError as error:
        raise ConfigError(f"reading {file!r} needs the tokenizers library: pip install "
                          "tokenizers") from error
    if not os.path.isfile(file):
        raise ConfigError(f"no tokenizer file at {file!r}")
    try:
        return _Tokenizer.from_file(file)
    except Exception as error:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"cannot read {file!r}: {error}") from error


def tokenizer_config(directory: str) -> dict[str, Any]:
    """``directory/tokenizer_config.json`` (special tokens, chat template) as a dict; ``{}``
    when the file is absent.

    Raises:
        ConfigError: the file is unreadable or not a JSON object.
    """
    return _read_json(directory, "tokenizer_config.json")


def _read_json(directory: str, name: str) -> dict[str, Any]:
    """``directory/name`` as a dict; ``{}`` when the file is absent."""
    file = os.path.join(directory, name)
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {file!r}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{file!r} must hold a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(path: str | None, config: ModelConfig) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model: ``HFTokenizer(path)`` when ``path/tokenizer.json`` exists
    (the config's special ids as fallbacks), otherwise a ``ByteTokenizer`` with the config's
    BOS and EOS ids (random-weight models, checkpoints saved without a tokenizer).

    Raises:
        ConfigError: the tokenizer produces ids the model's vocabulary does not hold.
    """
    if path is not None and os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer: ByteTokenizer | HFTokenizer = HFTokenizer(
            path, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    else:
        try:
            tokenizer = ByteTokenizer(config.bos_token_id, config.eos_token_id)
        except ConfigError as error:
            raise ConfigError(f"{path!r} has no tokenizer.json, and the model's special ids do "
                              f"not fit the byte tokenizer: {error}") from error
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"{tokenizer!r} needs a vocabulary of {tokenizer.vocab_size} ids, "
                          f"the model has {config.vocab_size}")
    return tokenizer
