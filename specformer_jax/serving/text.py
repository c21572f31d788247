"""An answer's text as its tokens arrive: decoded whole each time (a token may complete a character that the one
before began), cut at the first stop string, and held back while its end could still begin one, so a client never
sees a stop string or part of one."""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max(map(len, stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.stopped = False  # a stop string was seen: the answer ends before it

    def add(self, ids: list[int]) -> str:
        """The text that may be handed out after these tokens (empty while held back)."""
        if self.stopped:
            return ""
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._upto(text, min(hits))
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)  # a character whose bytes are not all out
        return self._upto(text, max(self.sent, end - self.hold))

    def rest(self) -> str:
        """What was held back, once the answer has ended without a stop string."""
        if self.stopped:
            return ""
        return self._upto(self.tokenizer.decode(self.ids, skip_special_tokens=True), None)

    def _upto(self, text: str, end: int | None) -> str:
        new = text[self.sent:end]
        self.sent += len(new)
        return new
