"""The plan file: a small msgpack header and flat little-endian int32 arrays, one section per rank.

Layout::

    b"FCPPLAN5" | u32 header length | sha256 of the header | header (msgpack map) | global section | rank 0 | ...

Each section is a msgpack map from array name to raw bytes. The header says where every section lies and holds its
sha256, so one rank's program is read, by offset, without reading the others, and any flipped bit is caught. The
header is validated with pydantic (the envelope, with limits on every count); each section, when read, is checked
for structure (:mod:`~fcp_compiler.format.plan_structure`: sizes agree, every index in range), so no reader indexes out
of bounds or allocates beyond what the file's own sizes imply; :mod:`fcp_compiler.format.validate` checks what they
mean.
"""

from __future__ import annotations

import enum
import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fcp_compiler.algorithms.ranges import expand_ranges
from fcp_compiler.errors import PlanFormatError, shown
from fcp_compiler.format.inputs import AttentionShape, HardwareProfile, Layout, MaskKind
from fcp_compiler.format.models import MODEL_PRESETS, NO_MODEL
from fcp_compiler.format.plan_structure import (check_joined_arrays, check_rank_arrays, check_ranks_arrays,
                                                check_tables)
from fcp_compiler.format.safe_io import open_regular_file


class TransferKind(enum.IntEnum):
    """What a pull edge carries (owner to user) or a push edge returns (user to owner): the `pull_*_kind` codes of
    the plan format, shared by the compiler, the validator, the simulator and the runtime."""

    KV = 0  # pull: K and V of a block's segments. Backward push along the same edge: dK, dV partials.
    Q = 1  # pull: Q of a query block for tiles run away from its owner (backward: Q, dO, LSE).
    # Push back along a Q edge: partial O and LSE (forward) or the dQ partial (backward).


MAGIC = b"FCPPLAN5"  # format 5 on: the header and every section carry a sha256
_LEGACY_MAGIC = b"FCPPLAN\0"  # formats up to 4
KINDS_MAGIC = b"FCPKINDS"  # a plan for each layer kind over one layout (fcp_compiler.format.kinds)
FORMAT_VERSION = 10  # 6: per-sequence masks (seq_window); 7: the model whose layer time the placement balances;
# 8: two link classes (a round is a matching per class: NVLink inside a node, the NIC across; nodes are runs of
# profile.gpus_per_node ranks), node fan-out (pulls re-sent inside a node by the one that crossed the NIC);
# 9: kv_prefetch (the plan was scheduled for a runtime that posts each pass's stage-0 K,V pulls before the pass);
# 10: each rank's device memory peak per pass in bytes (max_buffer_bytes_fwd/_bwd) and the budget it was held to
MAX_INT32 = 2**31 - 1
MAX_RANKS = 2**16  # the most ranks a plan may have (--gpus)
MAX_BLOCK_SIZE = 2**20  # the largest block, in tokens
MAX_COALESCE = 2**16  # forward rounds a stage (the backward's: twice); the compiler writes no more
MAX_HEADER_BYTES = 2**26
MAX_BYTES = 2**50  # the most bytes of device memory a header may claim for a rank
# The most (rank, stage) cells of both passes a plan may have: the simulator and the validator keep per-stage tables
# of every rank (a float64 table of this many cells is 64 MiB), so a reader's memory stays bounded by it.
MAX_RANK_STAGES = 2**23
_HEX = re.compile(r"[0-9a-f]*")
_PREFIX = len(MAGIC) + 4 + 32  # magic, header length, sha256 of the header
_ARRAY_DTYPE = np.dtype("<i4")

# Per-rank arrays. A "pull" is a KV or Q transfer from a block's owner to a rank that needs it; row i carries
# *_seg_count[i] segments, listed in order in *_segs, and travels in round *_round of the forward pass and
# *_bwd_round of the backward pass. A push returns a partial result along a pull: the sender's row points into its
# pull_recv rows, the receiver's row into its pull_send rows. Stage = round // coalesce. A pull is sent from the
# sender's own block (pull_send_source -1) or relayed: re-sent from the pull_recv row pull_send_source, which
# brought the block in an earlier stage of both passes; the backward's dK, dV pushed back along a relayed pull are
# added into that row's partial gradient before it is pushed on.
RANK_ARRAYS = (
    "blocks",  # block ids this rank holds, in plan-layout order
    "reshuffle_send_peer", "reshuffle_send_offset", "reshuffle_send_length",  # user layout -> peer's plan layout
    "reshuffle_recv_peer", "reshuffle_recv_offset", "reshuffle_recv_length",  # peer's user layout -> plan layout
    "pull_send_round", "pull_send_bwd_round", "pull_send_kind", "pull_send_block", "pull_send_peer",
    "pull_send_seg_count", "pull_send_segs", "pull_send_source",
    "pull_recv_round", "pull_recv_bwd_round", "pull_recv_kind", "pull_recv_block", "pull_recv_peer",
    "pull_recv_seg_count", "pull_recv_segs",
    "tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block",  # in forward pipeline order
    "fwd_push_send_round", "fwd_push_send_pull", "fwd_push_recv_round", "fwd_push_recv_pull",
    "bwd_push_send_round", "bwd_push_send_pull", "bwd_push_recv_round", "bwd_push_recv_pull",
)
GLOBAL_ARRAYS = ("seq_lengths", "seq_window", "seg_block", "seg_seq", "seg_start", "seg_end")


class FieldsError(ValueError):
    """A check of a model over several of its fields, which it names: :func:`validation_reason` says "fields 'a',
    'b': ..." rather than pydantic's bare model-level message."""

    def __init__(self, fields: tuple[str, ...], message: str):
        super().__init__(message)
        self.fields = fields


def validation_reason(error: ValidationError, what: str) -> str:
    """The first error of a pydantic validation of `what` (a header) as one line: "WHAT field 'a.b': must be ...
    (got VALUE)", "WHAT fields 'a', 'b': ..." for a check over several (:class:`FieldsError`), or "WHAT: ..." for
    another check of the whole; the value is cut to a sane length (:func:`~fcp_compiler.errors.shown`)."""
    detail = error.errors()[0]
    message = detail["msg"].removeprefix("Value error, ")
    if detail["type"] == "missing":
        message = "missing"
    elif detail["type"] == "extra_forbidden":
        message = "is not a field of this format"
    elif message.startswith("Input should be "):
        message = "must be " + message.removeprefix("Input should be ")
    fields = getattr(detail.get("ctx", {}).get("error"), "fields", None)
    if fields:
        return f"{what} field{'s' if len(fields) > 1 else ''} {', '.join(map(repr, fields))}: {message}"
    if not detail["loc"]:
        return f"{what}: {message}"
    where = ".".join(map(str, detail["loc"]))
    got = shown(detail.get("input"))
    if detail["type"] != "missing" and "got" not in message and got not in message:
        message += f" (got {got})"
    return f"{what} field {where!r}: {message}"


def rank_stages_excess(num_ranks: int, num_stages: int) -> str | None:
    """Why a plan of `num_ranks` ranks and `num_stages` stages (both passes) is too large to read in bounded memory
    (more than MAX_RANK_STAGES), or None where it is not."""
    cells = num_ranks * num_stages
    if cells <= MAX_RANK_STAGES:
        return None
    return (f"{num_ranks} ranks x {num_stages} stages (forward and backward) = {cells:,} rank-stages, more than the "
            f"{MAX_RANK_STAGES:,} fcp simulates and validates in bounded memory")


class PlanHeader(BaseModel):
    """The plan envelope: format version, inputs' digest, every parameter, and where each section lies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["fcp-plan"] = "fcp-plan"
    format_version: Literal[10] = FORMAT_VERSION
    planner: str = Field(..., description="the strategy that produced the plan, e.g. fcp")
    inputs_digest: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="sha256 of the canonical inputs")
    num_ranks: int = Field(..., ge=1, le=MAX_RANKS)
    block_size: int = Field(..., ge=64, le=MAX_BLOCK_SIZE)
    coalesce: int = Field(..., ge=1, le=MAX_COALESCE, description="rounds per stage of the forward pass")
    bwd_coalesce: int = Field(..., ge=1, le=2 * MAX_COALESCE,
                              description="rounds per stage of the backward pass, whose pulls take every other round: "
                                          "twice coalesce, so each stage holds as many pulls")
    token_cap: int = Field(..., ge=1, le=MAX_INT32)
    zigzag: bool
    mask: MaskKind
    num_sequences: int = Field(..., ge=1, le=MAX_INT32)
    total_tokens: int = Field(..., ge=1, le=MAX_INT32)
    num_blocks: int = Field(..., ge=1, le=MAX_INT32)
    shape: AttentionShape
    profile: HardwareProfile
    model: str = Field(..., description="the model preset whose per-rank layer time (linear layers on a rank's tokens "
                                        "plus its attention) the placement balances, or none (attention alone)")
    layout: Layout = Field(..., description="plan: every layer holds tokens in the plan layout (dispatched once); "
                                           "user: attention reshuffles to and from the user layout")
    num_rounds: int = Field(..., ge=0, le=MAX_INT32, description="rounds the forward pulls take")
    nvlink_degree: int = Field(..., ge=0, le=MAX_INT32,
                               description="Delta of the forward pulls inside nodes: the most any GPU sends or "
                                           "receives over NVLink, the fewest rounds that class can take")
    nvlink_lanes: int = Field(..., ge=1, le=64,
                              description="NVLink messages a GPU may send, and receive, in one round (NVLink rounds "
                                          "that fit in one: the NVLink to NIC bandwidth ratio, floored, at most 2); "
                                          "a GPU's NIC carries one message each way a round")
    nic_degree: int = Field(..., ge=0, le=MAX_INT32,
                            description="Delta of the forward pulls across nodes: the most any GPU's NIC sends or "
                                        "receives, the fewest rounds that class can take")
    num_fwd_rounds: int = Field(..., ge=0, le=MAX_INT32, description="rounds of the forward pass, pulls and pushes")
    num_bwd_rounds: int = Field(..., ge=0, le=MAX_INT32, description="rounds of the backward pass, pulls and pushes")
    num_fwd_stages: int = Field(..., ge=1, le=MAX_INT32)
    num_bwd_stages: int = Field(..., ge=1, le=MAX_INT32)
    recv_buffer_tokens: int = Field(..., ge=0, le=MAX_INT32, description="most pulled tokens a rank receives in "
                                                                         "one stage")
    max_buffer_tokens: int = Field(..., ge=0, le=MAX_INT32,
                                   description="most tokens of live received buffers (pulls, pushes, the stage in "
                                               "flight) on any rank in any stage")
    max_buffer_bytes_fwd: list[int] = Field(
        ..., description="per rank: the peak bytes of every tensor the runtime creates in the forward (accumulators, "
                         "received and sent buffers, each kernel call's packed inputs and outputs, index tensors), in "
                         "the plan's dtype and layout: fcp_compiler.format.memory")
    max_buffer_bytes_bwd: list[int] = Field(..., description="per rank: the same in the backward")
    memory_budget_bytes: int | None = Field(..., ge=0, le=MAX_BYTES,
                                            description="the most bytes a rank's pass may peak at, as compiled "
                                                        "(--memory-budget); None: no budget")
    pipelined: bool = Field(True, description="tiles run in the stage after their data (False: after all pulls)")
    rounds_kind: Literal["matching", "arbitrary"] = Field(
        "matching", description="matching: congestion-free rounds; arbitrary: pulls in edge order (ablation only)")
    reshuffle_overlap: bool = Field(True, description="tiles whose tokens stay local run during the reshuffle")
    kv_prefetch: bool = Field(False, description="the plan was scheduled (and is simulated) for a runtime that posts "
                                                 "each pass's stage-0 K,V pulls early: the forward's once K and V are "
                                                 "projected, while Q is; the backward's as the layer's backward "
                                                 "starts (fcp_runtime.prefetch_kv; plan layout only)")
    global_section: tuple[int, int] = Field(..., description="(offset, length) after the header")
    rank_sections: list[tuple[int, int]] = Field(..., description="(offset, length) of each rank's section")
    global_sha256: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="sha256 of the global section's bytes")
    rank_sha256: list[str] = Field(..., description="sha256 of each rank section's bytes (hex)")

    @model_validator(mode="after")
    def _counts_bounded(self) -> "PlanHeader":
        # Every count a reader loops over is bounded by what the plan can hold: each pass has at most one pull of
        # each kind per (rank, block) and one push back along each, so at most 4 N B messages; the backward spreads
        # them over every other round and pushes up to two stages late.
        # Every message has an int32 round in its sender's and its receiver's section, so the rank sections' bytes
        # bound the messages too: a reader's per-stage tables stay within a multiple of the file.
        section_bytes = sum(length for _, length in self.rank_sections)
        most_messages = min(4 * self.num_ranks * self.num_blocks, section_bytes // 4)
        for name, rounds, stages, per_stage in (("fwd", self.num_fwd_rounds, self.num_fwd_stages, self.coalesce),
                                                 ("bwd", self.num_bwd_rounds, self.num_bwd_stages, self.bwd_coalesce)):
            most_rounds = 2 * most_messages + 4 * per_stage
            if rounds > most_rounds or stages > rounds // per_stage + 2:
                raise FieldsError((f"num_{name}_rounds", f"num_{name}_stages"),
                                  f"num_{name}_rounds {rounds} and num_{name}_stages {stages} exceed what "
                                  f"{self.num_ranks} ranks and {self.num_blocks} blocks can use")
        if (excess := rank_stages_excess(self.num_ranks, self.num_fwd_stages + self.num_bwd_stages)) is not None:
            raise FieldsError(("num_ranks", "num_fwd_stages", "num_bwd_stages"), excess)
        if self.num_rounds > self.num_fwd_rounds or self.num_blocks > self.total_tokens:
            raise FieldsError(("num_rounds", "num_blocks"), f"num_rounds {self.num_rounds} or num_blocks "
                                                            f"{self.num_blocks} exceeds what the plan holds")
        return self

    @model_validator(mode="after")
    def _memory_per_rank(self) -> "PlanHeader":
        for name in ("max_buffer_bytes_fwd", "max_buffer_bytes_bwd"):
            values = getattr(self, name)
            if len(values) != self.num_ranks or any(not 0 <= value <= MAX_BYTES for value in values):
                raise FieldsError((name,), f"{name} must hold one value in [0, {MAX_BYTES}] per rank "
                                           f"({self.num_ranks}), got {len(values)} values")
        return self

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        if name != NO_MODEL and name not in MODEL_PRESETS:
            raise ValueError(f"model {shown(name)} must be one of {', '.join(sorted(MODEL_PRESETS))} or {NO_MODEL}")
        return name

    @field_validator("rank_sha256")
    @classmethod
    def _hex_digests(cls, digests: list[str]) -> list[str]:
        if any(len(d) != 64 for d in digests) or not _HEX.fullmatch("".join(digests)):
            bad = next(d for d in digests if len(d) != 64 or not _HEX.fullmatch(d))
            raise ValueError(f"rank_sha256 entry {shown(bad)} is not a sha256 hex digest")
        return digests


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalTables:
    """What every rank needs to know of the whole batch: lengths and the block/segment table."""

    seq_lengths: np.ndarray
    # Keys a query of each sequence sees back, itself included: query t sees t - w + 1 .. t; w = the length is
    # causal, 0 a full mask (every key of the sequence).
    seq_window: np.ndarray
    seg_block: np.ndarray
    seg_seq: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray

    @property
    def block_seg_offsets(self) -> np.ndarray:
        counts = np.bincount(self.seg_block, minlength=int(self.seg_block.max()) + 1 if self.seg_block.size else 0)
        return np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProgram:
    """One rank's slice of a plan, decoded; see RANK_ARRAYS for the meaning of each array."""

    rank: int
    header: PlanHeader
    tables: GlobalTables
    arrays: dict[str, np.ndarray]

    def seg_offsets(self, side: str) -> np.ndarray:
        """Offsets into pull_{side}_segs of each pull row's segments (rows + 1 entries); side is send or recv."""
        return np.concatenate(([0], np.cumsum(self.arrays[f"pull_{side}_seg_count"]))).astype(np.int64)

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return object.__getattribute__(self, "arrays")[name]
        except KeyError:
            raise AttributeError(name) from None


def encode_section(arrays: dict[str, np.ndarray | bytes]) -> bytes:
    """Pack named int arrays (or their little-endian int32 bytes) as a msgpack map of raw bytes."""
    packed = {}
    for name, values in arrays.items():
        if not isinstance(values, (bytes, memoryview)):
            values = np.asarray(values)
            assert values.size == 0 or (values.min() >= -(2**31) and values.max() < 2**31), name
            values = values.astype(_ARRAY_DTYPE).tobytes()
        packed[name] = values
    return msgpack.packb(packed, use_bin_type=True)


def int32_bytes(values: np.ndarray) -> memoryview:
    """Little-endian int32 bytes of an int array, as a memoryview to slice without copying."""
    values = np.asarray(values)
    if values.dtype != _ARRAY_DTYPE:
        assert values.size == 0 or (values.min() >= -(2**31) and values.max() < 2**31)
        values = values.astype(_ARRAY_DTYPE)
    return memoryview(np.ascontiguousarray(values)).cast("B")


def _decode_section(data: bytes, names: tuple[str, ...], what: str) -> dict[str, np.ndarray]:
    return {name: np.frombuffer(values, dtype=_ARRAY_DTYPE).astype(np.int64)
            for name, values in _unpack_section(data, names, what).items()}


def _unpack_section(data: bytes, names: tuple[str, ...], what: str) -> dict[str, bytes]:
    """A section's arrays as their raw little-endian int32 bytes, every name present and a whole number of values."""
    try:
        packed = msgpack.unpackb(data, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as error:
        raise PlanFormatError(f"{what} is not valid msgpack: {error}") from None
    if not isinstance(packed, dict) or set(packed) != set(names):
        got = sorted(map(str, packed))[:40] if isinstance(packed, dict) else type(packed).__name__
        raise PlanFormatError(f"{what} holds {got}, expected the arrays {sorted(names)}")
    bad = next((name for name in names if not isinstance(packed[name], bytes) or len(packed[name]) % 4), None)
    if bad is not None:
        raise PlanFormatError(f"{what}: array {bad} is not a whole number of int32 values")
    return {name: packed[name] for name in names}


def assemble(header_fields: dict, global_arrays: dict[str, np.ndarray],
             rank_arrays: list[dict[str, np.ndarray | bytes]]) -> bytes:
    """Lay out a plan file from its header fields (sections and digests excluded) and arrays.

    Layout: magic, u32 header length, sha256 of the header, the header (msgpack), the global section, then one
    section per rank; the header holds every section's place and sha256, so any flipped bit is caught by a reader.
    """
    return assemble_sections(header_fields, encode_section(global_arrays),
                             [encode_section(arrays) for arrays in rank_arrays])


def assemble_sections(header_fields: dict, global_bytes: bytes, rank_bytes: list[bytes]) -> bytes:
    """:func:`assemble` from sections already encoded (:func:`encode_section`), so that a caller may free the
    arrays they came from before the file's bytes are joined."""
    offset = len(global_bytes)
    sections = []
    for blob in rank_bytes:
        sections.append((offset, len(blob)))
        offset += len(blob)
    header = PlanHeader(**header_fields, global_section=(0, len(global_bytes)), rank_sections=sections,
                        global_sha256=hashlib.sha256(global_bytes).hexdigest(),
                        rank_sha256=[hashlib.sha256(blob).hexdigest() for blob in rank_bytes])
    header_bytes = msgpack.packb(header.model_dump(mode="json"), use_bin_type=True)
    return b"".join([MAGIC, struct.pack("<I", len(header_bytes)), hashlib.sha256(header_bytes).digest(), header_bytes,
                     global_bytes, *rank_bytes])


class _Source:
    """Bytes of a plan, from memory or from a regular file read by offset (never the whole file at once); with
    `window` (offset, length), the plan that range of the source holds (a layer kind's in a plan of layer kinds)."""

    def __init__(self, source: str | Path | bytes | bytearray | memoryview, window: tuple[int, int] | None = None):
        self._file, self._base = None, 0
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._data = memoryview(source)
            self.size = len(self._data)
            self.origin = "plan bytes"
        else:
            path = str(source)
            self.origin = f"plan file {path!r}"
            self._file, self.size = open_regular_file(path, "plan", PlanFormatError)
        if window is not None:
            offset, length = window
            if offset < 0 or length < 0 or offset + length > self.size:
                raise PlanFormatError(f"{self.origin}: a plan at [{offset}, {offset + length}) lies outside its "
                                      f"{self.size} bytes")
            self._base, self.size = offset, length

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def read(self, offset: int, length: int, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise PlanFormatError(f"{self.origin}: {what} [{offset}, {offset + length}) lies outside the file's "
                                  f"{self.size} bytes")
        offset += self._base
        if self._file is None:
            return bytes(self._data[offset:offset + length])
        self._file.seek(offset)
        data = self._file.read(length)
        if len(data) != length:
            raise PlanFormatError(f"{self.origin}: the file ends inside {what}")
        return data


class PlanReader:
    """Random access to a plan: the header on open (checked against its sha256), any rank's section on demand (read
    by offset, checked against its sha256 and for structure: sizes agree, every index in range).

    `encoded_here`: the bytes are a plan this process has just encoded (a CompiledPlan's, as the floor scores its
    candidates), so the structural checks of each rank, which guard against plans from elsewhere, are skipped.
    """

    def __init__(self, source: str | Path | bytes, *, encoded_here: bool = False, window: tuple[int, int] | None = None,
                 origin: str | None = None):
        self._encoded_here = encoded_here
        self._source = _Source(source, window)
        self.origin = origin or self._source.origin
        prefix = self._source.read(0, min(_PREFIX, self._source.size), "the header")
        if prefix[:8] == _LEGACY_MAGIC:
            raise PlanFormatError(f"{self.origin} was written by an older fcp (format 4 or earlier); this fcp reads "
                                  f"version {FORMAT_VERSION}: compile it again")
        if prefix[:8] == KINDS_MAGIC:
            raise PlanFormatError(f"{self.origin} holds a plan for each of several layer kinds; read it with "
                                  f"fcp_compiler.format.kinds.PlanKinds (fcp inspect lists its kinds)")
        if prefix[:8] != MAGIC or len(prefix) < _PREFIX:
            raise PlanFormatError(f"{self.origin} is not an fcp plan (bad magic {prefix[:8]!r})")
        (header_len,) = struct.unpack("<I", prefix[8:12])
        if header_len > MAX_HEADER_BYTES:
            raise PlanFormatError(f"{self.origin}: header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
        header_bytes = self._source.read(_PREFIX, header_len, "the header")
        if hashlib.sha256(header_bytes).digest() != prefix[12:_PREFIX]:
            raise PlanFormatError(f"{self.origin}: the header does not match its sha256 (corrupt plan)")
        self.header = _parse_header(header_bytes, self.origin)
        self._body = _PREFIX + header_len
        self.body_offset = self._body  # where the sections begin
        header = self.header
        sections = [header.global_section, *header.rank_sections]
        if len(header.rank_sections) != header.num_ranks or len(header.rank_sha256) != header.num_ranks:
            raise PlanFormatError(f"{self.origin}: {len(header.rank_sections)} rank sections and "
                                  f"{len(header.rank_sha256)} digests for {header.num_ranks} ranks")
        if any(offset < 0 or length < 0 for offset, length in sections) or \
                self._body + max(offset + length for offset, length in sections) != self._source.size:
            raise PlanFormatError(f"{self.origin}: sections do not match the file's {self._source.size} bytes")
        self._tables: GlobalTables | None = None

    def _section(self, where: tuple[int, int], digest: str, what: str) -> bytes:
        offset, length = where
        data = self._source.read(self._body + offset, length, what)
        if hashlib.sha256(data).hexdigest() != digest:
            raise PlanFormatError(f"{self.origin}: {what} does not match its sha256 (corrupt plan)")
        return data

    @property
    def tables(self) -> GlobalTables:
        """The batch-wide tables (decoded and checked once)."""
        if self._tables is None:
            what = f"{self.origin} global section"
            arrays = _decode_section(self._section(self.header.global_section, self.header.global_sha256,
                                                   "the global section"), GLOBAL_ARRAYS, what)
            check_tables(what, self.header, arrays)
            self._tables = GlobalTables(**arrays)
            self._block_tokens = np.bincount(arrays["seg_block"], weights=arrays["seg_end"] - arrays["seg_start"],
                                             minlength=self.header.num_blocks).astype(np.int64)
            self._block_seg_offsets = self._tables.block_seg_offsets
            self._block_num_segments = np.diff(self._block_seg_offsets)
        return self._tables

    def rank(self, rank: int, expand: bool = True) -> RankProgram:
        """Decode and structurally check one rank's program only. With `expand` (the default) a pull stored as
        seg_count 0 gets its block's full segment list; without it the compact rows stay (for readers that need
        only each pull's tokens, on plans whose whole-block lists would be large).

        Raises:
            PlanFormatError: rank out of range, a corrupt section, or an index out of range.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.header.num_ranks:
            raise PlanFormatError(f"rank {rank!r} is out of range for a plan of {self.header.num_ranks} ranks "
                                  f"(0..{self.header.num_ranks - 1})")
        arrays = self._decode_rank(rank)
        if not self._encoded_here:
            tables = self.tables
            check_rank_arrays(self._rank_what(rank), self.header, arrays, tables.seg_block.size, self._block_tokens,
                              self._block_num_segments, rank)
        return self._program(rank, arrays, expand)

    def ranks(self, expand: bool = True) -> list[RankProgram]:
        """Every rank's program (see :meth:`rank` for `expand`), structurally checked in one pass over all ranks
        (:func:`check_ranks_arrays`: the same checks, and the same message for the first bad rank).

        Raises:
            PlanFormatError: a corrupt section, or an index out of range.
        """
        decoded = [self._decode_rank(rank) for rank in range(self.header.num_ranks)]
        if not self._encoded_here:
            tables = self.tables
            check_ranks_arrays(self._rank_what, self.header, decoded, tables.seg_block.size, self._block_tokens,
                               self._block_num_segments)
        return [self._program(rank, arrays, expand) for rank, arrays in enumerate(decoded)]

    def joined_ranks(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every rank's arrays as stored (a whole-block pull lists no segments), all ranks end to end: per RANK_ARRAYS
        name the int64 values and each rank's bounds in them (num_ranks + 1 entries). The sections are checked as
        :meth:`ranks` checks them (the same errors), but no rank is decoded on its own: each array is one join of
        every rank's bytes (thousands of ranks times two dozen arrays were seconds of small decodes).

        Raises:
            PlanFormatError: a corrupt section, or an index out of range.
        """
        sections = [_unpack_section(self._section(self.header.rank_sections[rank], self.header.rank_sha256[rank],
                                                  f"rank {rank}'s section"), RANK_ARRAYS, self._rank_what(rank))
                    for rank in range(self.header.num_ranks)]
        arrays, bounds = {}, {}
        for name in RANK_ARRAYS:
            parts = [section[name] for section in sections]
            bounds[name] = np.concatenate(([0], np.cumsum([len(part) // 4 for part in parts]))).astype(np.int64)
            arrays[name] = np.frombuffer(b"".join(parts), dtype=_ARRAY_DTYPE).astype(np.int64)
        del sections
        if not self._encoded_here:
            tables = self.tables
            check_joined_arrays(self._rank_what, self.header, arrays, bounds, tables.seg_block.size,
                                self._block_tokens, self._block_num_segments)
        return arrays, bounds

    def _rank_what(self, rank: int) -> str:
        return f"{self.origin} rank {rank} section"

    def _decode_rank(self, rank: int) -> dict[str, np.ndarray]:
        """One rank's arrays, its section checked against its sha256 and decoded (no structural check)."""
        return _decode_section(self._section(self.header.rank_sections[rank], self.header.rank_sha256[rank],
                                             f"rank {rank}'s section"), RANK_ARRAYS, self._rank_what(rank))

    def _program(self, rank: int, arrays: dict[str, np.ndarray], expand: bool) -> RankProgram:
        tables = self.tables
        for side in ("send", "recv") if expand else ():
            expand_whole_blocks(arrays, side, self._block_seg_offsets, self._block_num_segments)
        return RankProgram(rank=rank, header=self.header, tables=tables, arrays=arrays)


def expand_whole_blocks(arrays: dict[str, np.ndarray], side: str, block_seg_offsets: np.ndarray,
                        block_num_segments: np.ndarray) -> None:
    """Write out the segment list of every pull stored as seg_count 0 (every segment of its block), so that every
    reader sees explicit lists."""
    counts = arrays[f"pull_{side}_seg_count"]
    whole = counts == 0
    if not whole.any():
        return
    blocks = arrays[f"pull_{side}_block"]
    first, size = block_seg_offsets[blocks], block_num_segments[blocks]
    full = np.where(whole, size, counts)
    stored = np.concatenate(([0], np.cumsum(counts)))[:-1]
    # Positions: a whole row's are its block's segment ids; another row's index its stored list.
    positions = expand_ranges(np.where(whole, first, stored), full)
    from_list = ~np.repeat(whole, full)
    positions[from_list] = arrays[f"pull_{side}_segs"][positions[from_list]]
    arrays[f"pull_{side}_segs"] = positions
    arrays[f"pull_{side}_seg_count"] = full


def _parse_header(header_bytes: bytes, origin: str) -> PlanHeader:
    try:
        raw = msgpack.unpackb(header_bytes, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as error:
        raise PlanFormatError(f"{origin}: header is not valid msgpack: {error}") from None
    if isinstance(raw, dict) and raw.get("format_version") not in (None, FORMAT_VERSION):
        raise PlanFormatError(f"{origin}: format_version {shown(raw.get('format_version'))} is not supported "
                              f"(this fcp reads version {FORMAT_VERSION}): compile it again with this fcp")
    try:
        return PlanHeader.model_validate(raw)
    except ValidationError as error:
        raise PlanFormatError(f"{origin}: {validation_reason(error, 'header')}") from None


def load_rank_program(source: str | Path | bytes, rank: int) -> RankProgram:
    """Read just one rank's program from a plan file or bytes."""
    return PlanReader(source).rank(rank)


def rebuild_plan(reader: PlanReader, rank_arrays: list[dict[str, np.ndarray]] | None = None,
                 **header_changes: object) -> bytes:
    """Re-serialise a plan with some rank arrays or header fields replaced (for tools and tests that edit plans)."""
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
    fields.update(header_changes)
    tables = reader.tables
    global_arrays = {name: getattr(tables, name) for name in GLOBAL_ARRAYS}
    arrays = rank_arrays if rank_arrays is not None else [program.arrays for program in reader.ranks()]
    return assemble(fields, global_arrays, arrays)
