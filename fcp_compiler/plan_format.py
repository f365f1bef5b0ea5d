"""The plan file: a small msgpack header and flat little-endian int32 arrays, one section per rank.

Layout::

    b"FCPPLAN\\0" | u32 header length | header (msgpack map) | global section | rank 0 section | ... | rank N-1

Each section is a msgpack map from array name to raw bytes. The header says where every section lies, so one
rank's program is read without decoding the others. The header is validated with pydantic (the envelope); the
arrays are not, for speed: :mod:`fcp_compiler.validate` checks what they mean.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fcp_compiler.algorithms.ranges import expand_ranges
from fcp_compiler.errors import PlanFormatError
from fcp_compiler.inputs import AttentionShape, HardwareProfile, Layout, MaskKind

MAGIC = b"FCPPLAN\0"
FORMAT_VERSION = 4
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
GLOBAL_ARRAYS = ("seq_lengths", "seg_block", "seg_seq", "seg_start", "seg_end")


class PlanHeader(BaseModel):
    """The plan envelope: format version, inputs' digest, every parameter, and where each section lies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["fcp-plan"] = "fcp-plan"
    format_version: Literal[4] = FORMAT_VERSION
    planner: str = Field(..., description="the strategy that produced the plan, e.g. fcp")
    inputs_digest: str = Field(..., pattern=r"^[0-9a-f]{64}$", description="sha256 of the canonical inputs")
    num_ranks: int = Field(..., ge=1)
    block_size: int = Field(..., ge=64)
    coalesce: int = Field(..., ge=1, description="rounds per stage of the forward pass")
    bwd_coalesce: int = Field(..., ge=1, description="rounds per stage of the backward pass, whose pulls take every "
                                                   "other round: twice coalesce, so each stage holds as many pulls")
    token_cap: int = Field(..., ge=1)
    zigzag: bool
    mask: MaskKind
    num_sequences: int = Field(..., ge=1)
    total_tokens: int = Field(..., ge=1)
    num_blocks: int = Field(..., ge=1)
    shape: AttentionShape
    profile: HardwareProfile
    layout: Layout = Field(..., description="plan: every layer holds tokens in the plan layout (dispatched once); "
                                           "user: attention reshuffles to and from the user layout")
    num_rounds: int = Field(..., ge=0, description="rounds of the forward pulls (their largest degree)")
    num_fwd_rounds: int = Field(..., ge=0, description="rounds of the forward pass, pulls and pushes")
    num_bwd_rounds: int = Field(..., ge=0, description="rounds of the backward pass, pulls and pushes")
    num_fwd_stages: int = Field(..., ge=1)
    num_bwd_stages: int = Field(..., ge=1)
    recv_buffer_tokens: int = Field(..., ge=0, description="most pulled tokens a rank receives in one stage")
    max_buffer_tokens: int = Field(..., ge=0, description="most tokens of live received buffers (pulls, pushes, "
                                                          "the stage in flight) on any rank in any stage")
    pipelined: bool = Field(True, description="tiles run in the stage after their data (False: after all pulls)")
    rounds_kind: Literal["matching", "arbitrary"] = Field(
        "matching", description="matching: congestion-free rounds; arbitrary: pulls in edge order (ablation only)")
    reshuffle_overlap: bool = Field(True, description="tiles whose tokens stay local run during the reshuffle")
    global_section: tuple[int, int] = Field(..., description="(offset, length) after the header")
    rank_sections: list[tuple[int, int]] = Field(..., description="(offset, length) of each rank's section")


@dataclass(frozen=True, slots=True, kw_only=True)
class GlobalTables:
    """What every rank needs to know of the whole batch: lengths and the block/segment table."""

    seq_lengths: np.ndarray
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
    assert values.size == 0 or (values.min() >= -(2**31) and values.max() < 2**31)
    return memoryview(values.astype(_ARRAY_DTYPE).tobytes())


def _decode_section(data: bytes, names: tuple[str, ...], what: str) -> dict[str, np.ndarray]:
    try:
        packed = msgpack.unpackb(data, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as error:
        raise PlanFormatError(f"{what} is not valid msgpack: {error}") from None
    if not isinstance(packed, dict) or set(packed) != set(names):
        got = sorted(packed) if isinstance(packed, dict) else type(packed).__name__
        raise PlanFormatError(f"{what} holds {got}, expected the arrays {sorted(names)}")
    return {name: np.frombuffer(packed[name], dtype=_ARRAY_DTYPE).astype(np.int64) for name in names}


def assemble(header_fields: dict, global_arrays: dict[str, np.ndarray],
             rank_arrays: list[dict[str, np.ndarray | bytes]]) -> bytes:
    """Lay out a plan file from its header fields (sections excluded) and arrays."""
    global_bytes = encode_section(global_arrays)
    rank_bytes = [encode_section(arrays) for arrays in rank_arrays]
    offset = len(global_bytes)
    sections = []
    for blob in rank_bytes:
        sections.append((offset, len(blob)))
        offset += len(blob)
    header = PlanHeader(**header_fields, global_section=(0, len(global_bytes)), rank_sections=sections)
    header_bytes = msgpack.packb(header.model_dump(mode="json"), use_bin_type=True)
    return b"".join([MAGIC, struct.pack("<I", len(header_bytes)), header_bytes, global_bytes, *rank_bytes])


class PlanReader:
    """Random access to a plan file: the header on open, any rank's section on demand."""

    def __init__(self, source: str | Path | bytes):
        if isinstance(source, (bytes, bytearray, memoryview)):
            self._data = memoryview(source)
            self.origin = "plan bytes"
        else:
            path = Path(source)
            try:
                self._data = memoryview(path.read_bytes())
            except FileNotFoundError:
                raise PlanFormatError(f"plan file {str(path)!r} does not exist") from None
            except (IsADirectoryError, PermissionError) as error:
                raise PlanFormatError(f"plan file {str(path)!r} cannot be read: {error.__class__.__name__}") \
                    from None
            self.origin = f"plan file {str(path)!r}"
        if bytes(self._data[:8]) != MAGIC or len(self._data) < 12:
            raise PlanFormatError(f"{self.origin} is not an fcp plan (bad magic {bytes(self._data[:8])!r})")
        (header_len,) = struct.unpack("<I", self._data[8:12])
        try:
            raw = msgpack.unpackb(self._data[12:12 + header_len], raw=False)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as error:
            raise PlanFormatError(f"{self.origin}: header is not valid msgpack: {error}") from None
        if isinstance(raw, dict) and raw.get("format_version") not in (None, FORMAT_VERSION):
            raise PlanFormatError(f"{self.origin}: format_version {raw.get('format_version')!r} is not supported "
                                  f"(this fcp reads version {FORMAT_VERSION})")
        try:
            self.header = PlanHeader.model_validate(raw)
        except ValidationError as error:
            detail = error.errors()[0]
            raise PlanFormatError(f"{self.origin}: header field {'.'.join(map(str, detail['loc']))}: "
                                  f"{detail['msg']}") from None
        self._body = 12 + header_len
        end = max([sum(self.header.global_section)] + [sum(s) for s in self.header.rank_sections])
        if len(self.header.rank_sections) != self.header.num_ranks or self._body + end != len(self._data):
            raise PlanFormatError(f"{self.origin}: sections do not match the file ({len(self._data)} bytes, "
                                  f"{len(self.header.rank_sections)} rank sections for {self.header.num_ranks} ranks)")
        self._tables: GlobalTables | None = None

    def _section(self, where: tuple[int, int]) -> bytes:
        offset, length = where
        return self._data[self._body + offset:self._body + offset + length]

    @property
    def tables(self) -> GlobalTables:
        """The batch-wide tables (decoded once)."""
        if self._tables is None:
            arrays = _decode_section(self._section(self.header.global_section), GLOBAL_ARRAYS,
                                     f"{self.origin} global section")
            self._tables = GlobalTables(**arrays)
        return self._tables

    def rank(self, rank: int) -> RankProgram:
        """Decode one rank's program only.

        Raises:
            PlanFormatError: rank out of range or a corrupt section.
        """
        if not 0 <= rank < self.header.num_ranks:
            raise PlanFormatError(f"rank {rank} is out of range for a plan of {self.header.num_ranks} ranks")
        arrays = _decode_section(self._section(self.header.rank_sections[rank]), RANK_ARRAYS,
                                 f"{self.origin} rank {rank} section")
        return RankProgram(rank=rank, header=self.header, tables=self.tables, arrays=arrays)

    def ranks(self) -> list[RankProgram]:
        """Every rank's program."""
        return [self.rank(rank) for rank in range(self.header.num_ranks)]


def tiles_during_reshuffle(program: RankProgram) -> np.ndarray:
    """Which of a rank's tiles may run while the input reshuffle is in flight: stage-0 tiles whose query and key
    blocks the rank holds and whose tokens all stay on it (a run from the rank to itself). Bool per tile row; all
    False in the plan layout, which has no reshuffle."""
    a, tables = program.arrays, program.tables
    if program.header.layout is Layout.PLAN:
        return np.zeros(a["tile_stage"].size, dtype=bool)
    seg_ptr = np.searchsorted(tables.seg_block, np.arange(program.header.num_blocks + 1))
    block_tokens = np.add.reduceat(tables.seg_end - tables.seg_start, seg_ptr[:-1])
    held = a["blocks"]
    mine = a["reshuffle_recv_peer"] == program.rank
    stays = np.zeros(int(block_tokens[held].sum()), dtype=bool)
    stays[expand_ranges(a["reshuffle_recv_offset"][mine], a["reshuffle_recv_length"][mine])] = True
    block_stays = np.zeros(program.header.num_blocks, dtype=bool)
    if held.size:
        starts = np.concatenate(([0], np.cumsum(block_tokens[held])[:-1]))
        block_stays[held] = np.logical_and.reduceat(stays, starts) if stays.size else True
    return (a["tile_stage"] == 0) & block_stays[a["tile_q_block"]] & block_stays[a["tile_kv_block"]]


def stack_ranks(programs: list[RankProgram], name: str) -> tuple[np.ndarray, np.ndarray]:
    """One per-rank array concatenated over ranks, and the rank of each row."""
    values = [program.arrays[name] for program in programs]
    ranks = np.repeat(np.arange(len(programs)), [v.size for v in values])
    return (np.concatenate(values) if values else np.zeros(0, dtype=np.int64)), ranks


def load_rank_program(source: str | Path | bytes, rank: int) -> RankProgram:
    """Read just one rank's program from a plan file or bytes."""
    return PlanReader(source).rank(rank)


def rebuild_plan(reader: PlanReader, rank_arrays: list[dict[str, np.ndarray]] | None = None,
                 **header_changes: object) -> bytes:
    """Re-serialise a plan with some rank arrays or header fields replaced (for tools and tests that edit plans)."""
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections"})
    fields.update(header_changes)
    tables = reader.tables
    global_arrays = {name: getattr(tables, name) for name in GLOBAL_ARRAYS}
    arrays = rank_arrays if rank_arrays is not None else [program.arrays for program in reader.ranks()]
    return assemble(fields, global_arrays, arrays)
