"""Error hierarchy of the compiler. Every message quotes the offending value."""


class FcpError(Exception):
    """Base class of every error the compiler raises on purpose."""


class InvalidInputError(FcpError, ValueError):
    """An input (batch, flag, profile, file) is malformed or out of range."""


class InfeasibleError(FcpError):
    """The inputs are well formed but no plan can satisfy them (e.g. a token cap too small)."""


class PlanFormatError(FcpError):
    """A plan file is corrupt, of an unknown version, or breaks an invariant."""


SHOWN_CHARS = 60  # the most characters of a value a message echoes


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """Text a message echoes, cut to `limit` characters: a longer one (a 10,000-character name) is shown by its
    start, an ellipsis and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """A value as a one-line message quotes it: its repr, cut as :func:`clipped` cuts (a string's start quoted)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    return clipped(repr(value), limit)
