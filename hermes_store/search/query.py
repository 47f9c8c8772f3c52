"""The search query, parsed once: the original store's sanitizer, then terms and AND/OR/NOT.

The original store answered any FTS5 syntax error with ``[]``, so ``TODO: fix`` or
``src/app/main.py`` found nothing. Here every query goes through the original store's
sanitizer and is parsed once into terms and operators; each backend's searcher renders that
parse for its engine (an FTS5 query of quoted phrases, a PostgreSQL tsquery of quoted operands,
a substring predicate), so the user's text only ever travels as a bound parameter.

Pure text: no database and no SQLAlchemy here (``schema.ddl`` is constants only).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hermes_store.schema import ddl

#: Past these, queries are clipped: SQLite refuses LIKE patterns over 50,000 bytes and
#: expressions deeper than 1,000 terms; no real query comes near either.
MAX_QUERY_CHARS = 10_000
MAX_ITEMS = 64
MAX_PIECES = 16
OPERATORS = frozenset({"AND", "OR", "NOT"})

# -- the original store's sanitizer ----------------------------------------------------------

#: A balanced ``"..."`` phrase.
QUOTED_PHRASE = re.compile(r'"[^"]*"')
_UNMATCHED_SPECIAL = re.compile(r'[+{}()"^]')
_STAR_RUN = re.compile(r"\*+")
_LEADING_STAR = re.compile(r"(^|\s)\*")
_LEADING_OPERATOR = re.compile(r"^(?:AND|OR|NOT)(?=\s|$)\s*")
_TRAILING_OPERATOR = re.compile(r"(?:^|\s+)(?:AND|OR|NOT)$")
_JOINED_TERM = re.compile(r"\b(\w+(?:[.-]\w+)+)\b")
_PLACEHOLDER = re.compile("\x00Q(\\d+)\x00")
_UNUSABLE = re.compile("[\x00\ud800-\udfff]")  # NUL and lone surrogates: no engine takes them

_CJK_RANGES = (
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0x3400, 0x4DBF),  # extension A
    (0x20000, 0x2A6DF),  # extension B
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3040, 0x309F),  # hiragana
    (0x30A0, 0x30FF),  # katakana
    (0xAC00, 0xD7AF),  # hangul syllables
)


def sanitize_fts5_query(query: str) -> str:
    """The original store's six steps, so user text cannot break FTS5's grammar in the common cases.

    (1) protect balanced ``"..."`` phrases; (2) unmatched ``+ { } ( ) " ^`` become spaces;
    (3) collapse ``*`` runs and drop a ``*`` that starts a term; (4) drop dangling AND/OR/NOT at
    either end; (5) quote terms joined by ``-`` or ``.``; (6) restore the phrases and strip.
    NUL characters become spaces first: neither engine can take them.
    """
    phrases: list[str] = []

    def protect(match: re.Match[str]) -> str:
        phrases.append(match.group(0))
        return f"\x00Q{len(phrases) - 1}\x00"

    text = QUOTED_PHRASE.sub(protect, query.replace("\x00", " "))
    text = _UNMATCHED_SPECIAL.sub(" ", text)
    text = _STAR_RUN.sub("*", text)
    text = _LEADING_STAR.sub(r"\1", text)
    previous = None
    while previous != text:  # "a AND OR" needs two rounds
        previous = text
        text = _LEADING_OPERATOR.sub("", text.strip())
        text = _TRAILING_OPERATOR.sub("", text).strip()
    text = _JOINED_TERM.sub(r'"\1"', text)
    text = _PLACEHOLDER.sub(lambda m: phrases[int(m.group(1))], text)
    return text.strip()


# One scan in C each: testing every character against every range in Python took most of
# the time of parsing a short query.
_CJK_CHARACTER = re.compile(ddl.character_class(_CJK_RANGES))
_UNSEGMENTED_CHARACTER = re.compile(ddl.UNSEGMENTED_CLASS)


def contains_cjk(text: str) -> bool:
    """The original store's test: any Chinese character, Japanese kana, Korean hangul or CJK
    punctuation."""
    return _CJK_CHARACTER.search(text) is not None


def unsegmented(text: str) -> bool:
    """Whether any character is of a script written without spaces (CJK, Thai, Khmer...: the
    ranges the CJK index's triggers test), so words are only findable as substrings."""
    return _UNSEGMENTED_CHARACTER.search(text) is not None


# -- one parse of the sanitized query ------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One phrase of the query.

    ``words`` is what the full-text engines tokenize (quotes and ``*`` are separators there);
    ``pieces`` are the literal fragments a substring match needs, each a verbatim slice of what
    the user typed, so text the tokenizers cannot see (``!=``, ``->``, new scripts) is findable.
    """

    words: str
    pieces: tuple[str, ...]
    prefix: bool

    @property
    def indexable(self) -> bool:
        """Whether a tokenizer can make a token of it (letters, digits, private use)."""
        return any(_word_character(ch) for ch in self.words)


def _word_character(ch: str) -> bool:
    category = unicodedata.category(ch)
    return category[0] in "LN" or category == "Co"


Item = Term | str  # a str item is one of OPERATORS
T = TypeVar("T")


def parse_query(sanitized: str) -> list[Item]:
    """Split a sanitized query into terms and operators (whitespace inside quotes is kept)."""
    items: list[Item] = []
    for token in _tokens(sanitized):
        if token in OPERATORS:
            items.append(token)
            continue
        # A token of nothing but quotes and stars (a literal '""') is its own piece.
        pieces = tuple(p for p in re.split(r'["*]', token) if p.strip()) or (token,)
        words = " ".join(re.sub(r'["*]', " ", token).split())
        items.append(Term(words, pieces[:MAX_PIECES], prefix=token.endswith("*")))
    return items


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    current: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch.isspace() and not quoted:
            if current:
                tokens.append("".join(current))
                current = []
            continue
        current.append(ch)
    if current:
        tokens.append("".join(current))
    return tokens


def well_formed(items: Sequence[Item]) -> list[Item]:
    """Drop operators with nothing on one side; of adjacent operators keep the last ("AND NOT")."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, str):
            if out and isinstance(out[-1], str):
                out[-1] = item
            elif out:
                out.append(item)
        else:
            out.append(item)
    while out and isinstance(out[-1], str):
        out.pop()
    return out


def fold(
    items: Sequence[Item],
    leaf: Callable[[Term], T],
    all_of: Callable[[list[T]], T],
    any_of: Callable[[list[T]], T],
    negate: Callable[[T], T],
) -> T:
    """Evaluate a well-formed item list with FTS5's precedence: NOT, then AND, then OR."""
    alternatives: list[T] = []
    conjunction: list[T] = []
    pending: str | None = None
    for item in items:
        if isinstance(item, str):
            pending = item
            if item == "OR":
                alternatives.append(all_of(conjunction))
                conjunction = []
            continue
        value = leaf(item)
        if pending == "NOT":  # binary: "a NOT b" is a AND NOT b
            conjunction[-1] = all_of([conjunction[-1], negate(value)])
        else:
            conjunction.append(value)
        pending = None
    alternatives.append(all_of(conjunction))
    return any_of(alternatives)


def positive_pieces(items: Sequence[Item]) -> list[str]:
    """Fragments to highlight: those of every term that is not negated."""
    pieces: list[str] = []
    negated = False
    for item in items:
        if isinstance(item, str):
            negated = item == "NOT"
            continue
        if not negated:
            pieces.extend(item.pieces)
        negated = False
    return pieces


# -- the query a searcher gets -------------------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """A caller's query parsed once: ``text`` as given, ``sanitized`` by the original store's
    rules, ``items`` its well-formed terms and operators (at most MAX_ITEMS)."""

    text: str
    sanitized: str
    items: list[Item]

    @property
    def unsegmented(self) -> bool:
        """Whether the query holds a script written without spaces: then it is a substring
        match, since a word inside a longer run is no token of either full-text index."""
        return unsegmented(self.sanitized)

    def indexable(self) -> list[Item] | None:
        """The terms a tokenizer can index, with their operators; None when there is none
        (``->``, ``!=``, ``""``): the full-text engines have nothing to look up."""
        terms = well_formed([i for i in self.items if isinstance(i, str) or i.indexable])
        return terms or None


def clip(query: str) -> str:
    """At most MAX_QUERY_CHARS, cut at a space so no half word becomes a required term."""
    if len(query) <= MAX_QUERY_CHARS:
        return query
    clipped = query[:MAX_QUERY_CHARS]
    cut = clipped.rfind(" ")
    return clipped[:cut] if cut > 0 else clipped


def parse(text: str) -> Query | None:
    """``text`` clipped, sanitized and parsed; None when nothing searchable is left."""
    if not text or not text.strip():
        return None
    sanitized = sanitize_fts5_query(_UNUSABLE.sub(" ", clip(text)))
    if not sanitized:
        return None
    items = well_formed(well_formed(parse_query(sanitized))[:MAX_ITEMS])
    if not items:
        return None
    return Query(text, sanitized, items)
