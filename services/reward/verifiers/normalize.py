"""Text normalisation applied to both sides of a string comparison (exact and regex verifiers)."""

from __future__ import annotations

import dataclasses
import decimal
import re

_SPACES = re.compile(r"\s+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Normalization:
    strip: bool = True
    casefold: bool = False
    collapse_whitespace: bool = False  # runs of whitespace become one space
    strip_period: bool = False         # a trailing "." (as in "The answer is 7.") is dropped
    numbers: bool = False              # "1,000" "+1000" "1000.00" "1e3" all read "1000"

    def apply(self, text: str) -> str:
        if self.collapse_whitespace:
            text = _SPACES.sub(" ", text)
        if self.strip:
            text = text.strip()
        if self.strip_period and text.endswith(".") and not text.endswith(".."):  # not an ellipsis
            text = text[:-1].rstrip()
        if self.casefold:
            text = text.casefold()
        if self.numbers:
            text = canonical_number(text)
        return text


def canonical_number(text: str) -> str:
    """`text` as one canonical decimal when the whole of it is a number, else unchanged."""
    candidate = _THOUSANDS.sub("", text.strip())
    if not _PLAIN_NUMBER.fullmatch(candidate):
        return text
    value = decimal.Decimal(candidate)
    if abs(value.adjusted()) > 64:  # "1e999999999" is left as written, not expanded into a huge integer
        return text
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
