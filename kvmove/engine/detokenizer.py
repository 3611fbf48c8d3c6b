"""A generation's text, one token at a time, ended before its first stop string.

Both the engine (``EngineWorker``, to end a request on a stop string) and ``kvmove-serve``'s router
(to stream text deltas) used to decode a request's whole output again after every token and
search all of it for every stop string: O(n) work a token, O(n²) a request. 1,000 stop
strings of 50 characters cost 12.4 s of router CPU for one 2,000-token request. Here a token
costs one step of the tokenizer's incremental decoder (``Tokenizer.decode_stream``) and a
search of the text not yet released, which is never longer than the longest stop string plus
the token's own text: the work a token does is bounded by the stop strings, not by how much
came before.

Text that could still be the start of a stop string is held back until the next text
settles it (the stop string completes, or cannot any more), so text once released is never
taken back::

    stop "</s>", text so far "a b </":   released "a b ", held "</"
    next token ">x":                       no "</s>" in "</>x": released "</>x", held ""
    next token "</s":                      held "</s"  (could still become "</s>")
    next token ">":                        "</s>" found: stopped, nothing more released
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmove.engine.tokenizer import Tokenizer

__all__ = ["Detokenizer"]


class Detokenizer:
    """Token ids in, the text they release out, until a stop string or the end.

    Args:
        tokenizer: what decodes the ids (its ``decode_stream()``).
        stop: strings that end the text before them (none: the text is every token's).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._decoder = tokenizer.decode_stream()
        self._stop = tuple(stop)
        self._released: list[str] = []
        self._held = ""
        self.stopped = False  # a stop string was found: nothing after it is ever released

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    @property
    def held(self) -> str:
        """Text decoded but not released: it may be the start of a stop string."""
        return self._held

    def push(self, token: int) -> str:
        """The text ``token`` releases ("" while held back, and after a stop string)."""
        if self.stopped:
            return ""
        return self._advance(self._decoder.step(token))

    def flush(self) -> str:
        """The output ended without a stop string (EOS, ``max_tokens``): releases the text
        held back, and what an unfinished character decodes to."""
        if self.stopped:
            return ""
        text = self._advance(self._decoder.flush())
        if self.stopped:
            return text
        rest, self._held = self._held, ""
        self._released.append(rest)
        return text + rest

    def _advance(self, new: str) -> str:
        pending = self._held + new
        cut = _first_stop(pending, self._stop)
        if cut is not None:
            self.stopped, self._held = True, ""
            return self._release(pending[:cut])
        keep = _stop_prefix_length(pending, self._stop)
        self._held = pending[len(pending) - keep:]
        return self._release(pending[:len(pending) - keep])

    def _release(self, text: str) -> str:
        if text:
            self._released.append(text)
        return text


def _first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string in ``text`` begins, or None."""
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None


def _stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that a stop string begins with (shorter than
    that stop string: a whole one was looked for first).

    Only the places where a stop string holds ``text``'s last character can end such a
    prefix, so those are the only ones compared (``str.find``, not every length).
    """
    if not text:
        return 0
    last, best = text[-1], 0
    for s in stop:
        end = min(len(s) - 1, len(text))
        k = s.find(last, best, end)  # s[:k + 1] ends with the last character
        while k >= 0:
            if text.endswith(s[:k + 1]):
                best = k + 1
            k = s.find(last, k + 1, end)
    return best
