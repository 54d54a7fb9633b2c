"""A request's text as its tokens arrive: incremental detokenization (loading.TextStream) and
`stop` strings. Text that could still become the start of a stop string is held back until
it is clear it does not, so nothing past a stop is ever sent; the stop string itself is not
part of the answer (as with OpenAI)."""
from typing import Sequence, Tuple

from specdec_inductor.loading import TextStream


class StopText:
    """push(tokens) -> (new text to send, whether a stop string ended the answer);
    finish() -> the held-back rest once the request ended without a stop string.
    `tokens_used` counts the tokens up to and including the one that completed the stop."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.stream = TextStream(tokenizer)
        self.stops = list(stops)
        self.text, self.sent = "", 0  # everything decoded so far; how much of it was sent
        self.stopped = False
        self.tokens_used = 0

    def push(self, tokens: Sequence[int]) -> Tuple[str, bool]:
        if self.stopped:
            return "", True
        for tok in tokens:
            self.tokens_used += 1
            self.text += self.stream.push(tok)
            cut = self._stop_at()
            if cut is not None:
                self.stopped = True
                return self._send(cut), True
        return self._send(len(self.text) - self._held_back()), False

    def finish(self) -> str:
        """The rest after the last token (a partial character or a stop prefix that never
        completed)."""
        if self.stopped:
            return ""
        self.text += self.stream.flush()
        cut = self._stop_at()
        self.stopped = cut is not None
        return self._send(len(self.text) if cut is None else cut)

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def _stop_at(self):
        """Where the earliest stop string starts in the unsent text (None: none there)."""
        # A stop cannot start in sent text: its start would have been held back.
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of a stop string."""
        best = 0
        unsent = self.text[self.sent:]
        for s in self.stops:
            for k in range(min(len(s) - 1, len(unsent)), best, -1):
                if unsent.endswith(s[:k]):
                    best = k
                    break
        return best

