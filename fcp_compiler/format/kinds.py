"""The kinds file: one plan for each layer kind of a model, over one layout.

A model whose layers differ in mask (gpt-oss's 128-token sliding window beside full causal layers) runs every
layer on the same tokens' layout, so it is dispatched once; each kind has its own schedule, which pulls only the
blocks its mask reads. The file holds each kind's whole plan (format :data:`FORMAT_VERSION` of plan_format, with
its own header and checksums) after a small header naming the kinds::

    b"FCPKINDS" | u32 header length | sha256 of the header | header (JSON) | each kind's plan, back to back

The header is ``{"format": 1, "primary": NAME, "kinds": [{"name", "mask", "num_layers", "offset", "length"}]}``
(offsets from the end of the header). Every kind's plan is read by offset, as a plan file is: nothing is read
whole. :class:`PlanKinds` checks the header, and that the kinds' plan headers agree where one layout, one batch and
one attention shape must (:data:`SHARED_HEADER`): the runtime reads those from one kind for all. `fcp validate`
checks the rest of one layout (format/validate_kinds.py).
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fcp_compiler.errors import InvalidInputError, PlanFormatError, shown
from fcp_compiler.format.inputs import LAYER_KIND_NAME, MAX_LAYER_KINDS, MAX_LAYERS_OF_A_KIND, Mask, check_layer_kinds
from fcp_compiler.format.plan_format import KINDS_MAGIC, PlanReader, validation_reason
from fcp_compiler.format.safe_io import open_regular_file, parse_json

KINDS_FORMAT = 1
MAX_KINDS_HEADER_BYTES = 2**16  # eight kinds' names, masks and ranges take a few hundred bytes
_PREFIX = len(KINDS_MAGIC) + 4 + 32
# What every kind's plan header states alike: the batch and its blocks, where tokens live (one layout, one
# dispatch), the attention shape the runtime's tensors have (read from one kind for all), and the placement's
# planner, model, cluster and zigzag. A kind's own schedule (rounds, stages, coalesce, its mask, its memory) differs.
SHARED_HEADER = ("num_ranks", "block_size", "layout", "num_sequences", "total_tokens", "num_blocks", "token_cap",
                 "shape", "zigzag", "planner", "model", "profile")


class KindEntry(BaseModel):
    """One layer kind in the kinds header: its name, mask, layers in the model and where its plan lies."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(..., pattern=f"^{LAYER_KIND_NAME}$")
    mask: Mask
    num_layers: int = Field(..., ge=0, le=MAX_LAYERS_OF_A_KIND)
    offset: int = Field(..., ge=0)
    length: int = Field(..., ge=1)

    @field_validator("mask", mode="before")
    @classmethod
    def _mask(cls, value: object) -> object:
        return Mask.model_validate(value)


class KindsHeader(BaseModel):
    """The kinds file's header: every kind, its plans back to back in order, the primary among them."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: int
    primary: str
    kinds: list[KindEntry] = Field(..., min_length=1, max_length=MAX_LAYER_KINDS)

    @model_validator(mode="after")
    def _consistent(self) -> "KindsHeader":
        if self.format != KINDS_FORMAT:
            raise ValueError(f"kinds format {self.format} is not {KINDS_FORMAT}, the one this fcp reads")
        names = [kind.name for kind in self.kinds]
        if len(set(names)) != len(names):
            raise ValueError(f"layer kinds {names} name one kind twice")
        check_layer_kinds({kind.name: kind.mask for kind in self.kinds})
        if self.primary not in names:
            raise ValueError(f"primary kind {self.primary!r} is not among the kinds {names}")
        offset = 0
        for kind in self.kinds:
            if kind.offset != offset:
                raise ValueError(f"kind {kind.name!r}'s plan starts at {kind.offset}, not at {offset} where the one "
                                 f"before it ends")
            offset += kind.length
        return self


def encode_kinds(kinds: list[tuple[str, dict, int, bytes]], primary: str) -> bytes:
    """The kinds file of each kind's (name, mask as JSON, layers in the model, plan bytes), in that order."""
    entries, offset = [], 0
    for name, mask, num_layers, data in kinds:
        entries.append({"name": name, "mask": mask, "num_layers": num_layers, "offset": offset, "length": len(data)})
        offset += len(data)
    header = json.dumps({"format": KINDS_FORMAT, "primary": primary, "kinds": entries}, sort_keys=True,
                        separators=(",", ":")).encode()
    assert len(header) <= MAX_KINDS_HEADER_BYTES
    return b"".join([KINDS_MAGIC, struct.pack("<I", len(header)), hashlib.sha256(header).digest(), header,
                     *(data for _, _, _, data in kinds)])


def is_kinds_file(source: str | Path | bytes) -> bool:
    """Whether a plan file (or its bytes) is a kinds file: by its first eight bytes (a missing or unreadable file
    is not; its reader says why)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[:len(KINDS_MAGIC)]) == KINDS_MAGIC
    try:
        file, _ = open_regular_file(str(source), "plan", PlanFormatError)
    except PlanFormatError:
        return False
    with file:
        return file.read(len(KINDS_MAGIC)) == KINDS_MAGIC


class KindReader:
    """One layer kind of a plan file: its name, mask and layers in the model (None, None, 1 for a plan of one
    kind), and a reader of its plan."""

    def __init__(self, name: str | None, mask: Mask | None, num_layers: int, reader: PlanReader):
        self.name, self.mask, self.num_layers, self.reader = name, mask, num_layers, reader


class PlanKinds:
    """Every layer kind of a plan file: a kinds file's kinds, or one plan's as the single kind None.

    Raises:
        PlanFormatError: a bad magic, header (its sha256, its JSON, its fields) or a kind's range outside the file;
            each kind's plan is checked as a plan file is, by its PlanReader.
    """

    def __init__(self, source: str | Path | bytes):
        self.kinds_file = is_kinds_file(source)
        if not self.kinds_file:
            self.header, self.kinds = None, (KindReader(None, None, 1, PlanReader(source)),)
            self.origin = self.kinds[0].reader.origin
            return
        origin = "plan bytes" if isinstance(source, (bytes, bytearray, memoryview)) else f"plan file {str(source)!r}"
        self.origin = origin
        prefix, header_bytes = _read_header(source, origin)
        try:  # untrusted JSON: a key given twice, NaN, a huge number or deep nesting is refused
            raw = parse_json(header_bytes.decode("utf-8"), "kinds header")
        except UnicodeDecodeError:
            raise PlanFormatError(f"{origin}: bad kinds header: not UTF-8") from None
        except InvalidInputError as error:
            raise PlanFormatError(f"{origin}: bad {error}") from None
        try:
            self.header = KindsHeader.model_validate(raw)
        except ValidationError as error:
            raise PlanFormatError(f"{origin}: {validation_reason(error, 'bad kinds header')}") from None
        body = prefix + len(header_bytes)
        self.kinds = tuple(KindReader(entry.name, entry.mask, entry.num_layers,
                                      PlanReader(source, window=(body + entry.offset, entry.length),
                                                 origin=f"{origin} kind {entry.name!r}"))
                           for entry in self.header.kinds)
        if body + sum(entry.length for entry in self.header.kinds) != _size(source):
            raise PlanFormatError(f"{origin}: the kinds' plans do not end where the file does")
        _check_shared_header(origin, self.kinds)

    @property
    def names(self) -> list[str | None]:
        return [kind.name for kind in self.kinds]

    @property
    def primary(self) -> KindReader:
        """The kind the placement was scheduled for (a single plan's only kind)."""
        if self.header is None:
            return self.kinds[0]
        return next(kind for kind in self.kinds if kind.name == self.header.primary)

    def kind(self, name: str) -> KindReader:
        """A kind by name.

        Raises:
            PlanFormatError: naming the kinds the plan has.
        """
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise PlanFormatError(f"layer kind {shown(name)} is not in the plan; its kinds: "
                              f"{', '.join(str(known) for known in self.names)}")


def _check_shared_header(origin: str, kinds: tuple[KindReader, ...]) -> None:
    """Every kind's plan header states SHARED_HEADER's fields as the first kind's does (a nested one, the shape or
    the profile, compared field by field).

    Raises:
        PlanFormatError: naming the field, both kinds and both values.
    """
    first = kinds[0]
    for kind in kinds[1:]:
        for name in SHARED_HEADER:
            where, mine, theirs = _first_difference(name, getattr(first.reader.header, name),
                                                    getattr(kind.reader.header, name))
            if where is not None:
                raise PlanFormatError(f"{origin}: layer kind {kind.name!r} has {where} {shown(theirs)}, kind "
                                      f"{first.name!r} {shown(mine)}: a plan's layer kinds share one "
                                      f"layout, batch and attention shape")


def _first_difference(where: str, mine: object, theirs: object) -> tuple[str | None, object, object]:
    """(the dotted name of the first field where two header values differ, or None; the two values there)."""
    if hasattr(mine, "model_dump") and type(mine) is type(theirs):
        for name in type(mine).model_fields:
            found = _first_difference(f"{where}.{name}", getattr(mine, name), getattr(theirs, name))
            if found[0] is not None:
                return found
        return None, mine, theirs
    plain = [value.value if isinstance(value, enum.Enum) else value for value in (mine, theirs)]
    return (None if mine == theirs else where), *plain


def _size(source) -> int:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return len(source)
    file, size = open_regular_file(str(source), "plan", PlanFormatError)
    file.close()
    return size


def _read_header(source, origin: str) -> tuple[int, bytes]:
    """(where the header starts, the header's bytes), checked against its sha256 and its bound."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source[:_PREFIX + MAX_KINDS_HEADER_BYTES])
    else:
        file, _ = open_regular_file(str(source), "plan", PlanFormatError)
        with file:
            data = file.read(_PREFIX + MAX_KINDS_HEADER_BYTES)
    if len(data) < _PREFIX:
        raise PlanFormatError(f"{origin}: the file ends inside the kinds header")
    (length,) = struct.unpack("<I", data[8:12])
    if length > MAX_KINDS_HEADER_BYTES or _PREFIX + length > len(data):
        raise PlanFormatError(f"{origin}: kinds header length {length} exceeds the file or "
                              f"{MAX_KINDS_HEADER_BYTES} bytes")
    header = data[_PREFIX:_PREFIX + length]
    if hashlib.sha256(header).digest() != data[12:_PREFIX]:
        raise PlanFormatError(f"{origin}: the kinds header does not match its sha256 (corrupt plan)")
    return _PREFIX, header
