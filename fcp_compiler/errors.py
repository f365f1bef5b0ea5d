"""Error hierarchy of the compiler. Every message quotes the offending value."""


class FcpError(Exception):
    """Base class of every error the compiler raises on purpose."""


class InvalidInputError(FcpError, ValueError):
    """An input (batch, flag, profile, file) is malformed or out of range."""


class InfeasibleError(FcpError):
    """The inputs are well formed but no plan can satisfy them (e.g. a token cap too small)."""


class PlanFormatError(FcpError):
    """A plan file is corrupt, of an unknown version, or breaks an invariant."""
