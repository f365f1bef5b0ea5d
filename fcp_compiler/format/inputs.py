"""Boundary models: the batch, the attention shape and the hardware profile.

Pydantic lives here and in :mod:`fcp_compiler.format.plan_format` only; the passes work on frozen dataclasses.
The JSON Schema of each model is written into ``schemas/`` (see :func:`write_schemas`).
"""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fcp_compiler.algorithms.limits import MAX_SEGMENT_PAIRS
from fcp_compiler.errors import InvalidInputError, clipped, shown
from fcp_compiler.format.safe_io import parse_json, read_input_text

SCHEMA_VERSION = 1


class Layout(str, enum.Enum):
    """Where tokens live outside attention."""

    PLAN = "plan"  # dispatched once per step into the plan's layout; attention moves only blocks
    USER = "user"  # contiguous user-layout chunks; attention reshuffles Q, K, V in and O out


class MaskKind(str, enum.Enum):
    """Which keys a query token sees inside its own sequence."""

    CAUSAL = "causal"  # token t sees 0..t
    FULL = "full"  # every token of its sequence
    SLIDING_WINDOW = "sliding_window"  # causal, the W most recent keys: t - W + 1 .. t
    MIXED = "mixed"  # a plan's summary when its sequences have different masks (never an input)


INPUT_MASK_KINDS = ("causal", "full", "sliding_window")


class Mask(BaseModel):
    """One sequence's mask: ``"causal"``, ``"full"`` or ``{"kind": "sliding_window", "window": W}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: MaskKind
    window: Annotated[int, Field(strict=True)] | None = Field(
        None, description="sliding_window only: keys a query sees back, itself included (>= 1)")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: object) -> object:
        return {"kind": value} if isinstance(value, (str, MaskKind)) else value

    @field_validator("kind", mode="before")
    @classmethod
    def _an_input_kind(cls, kind: object) -> object:
        # "mixed" is a plan's summary of per-sequence masks, never a mask one gives.
        if isinstance(kind, MaskKind) and kind is not MaskKind.MIXED or kind in INPUT_MASK_KINDS:
            return kind
        if kind in (MaskKind.MIXED, MaskKind.MIXED.value):
            raise ValueError("mask 'mixed' only describes a plan; give each sequence's mask in 'masks'")
        raise ValueError(f"mask kind {shown(kind)} must be one of {', '.join(INPUT_MASK_KINDS)}")

    @model_validator(mode="after")
    def _window_matches_kind(self) -> "Mask":
        if self.kind is MaskKind.SLIDING_WINDOW:
            window = self.window
            if window is None:
                raise ValueError("a sliding_window mask needs a window: {\"kind\": \"sliding_window\", \"window\": "
                                 "4096}")
            if not 1 <= window <= MAX_BATCH_TOKENS:
                raise ValueError(f"window {window!r} must be an integer from 1 to {MAX_BATCH_TOKENS} (the keys a "
                                 f"query sees back, itself included)")
        elif self.window is not None:
            raise ValueError(f"a window ({self.window!r}) is given for a {self.kind.value} mask; only sliding_window "
                             f"takes one")
        return self

    def window_for(self, length: int) -> int:
        """The keys a query of a sequence of `length` tokens sees back, itself included: 0 for a full mask (every
        key), `length` for causal, min(W, length) for a window of W."""
        if self.kind is MaskKind.FULL:
            return 0
        return length if self.kind is MaskKind.CAUSAL else min(self.window, length)


class DType(str, enum.Enum):
    """Element type of Q, K, V on the wire."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP64 = "fp64"

    @property
    def num_bytes(self) -> int:
        """Bytes per element."""
        return {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}[self.value]


MAX_BATCH_TOKENS = 2**31 - 1  # a plan stores token counts and offsets as int32
MAX_SEQUENCES = MAX_SEGMENT_PAIRS  # every sequence is at least one segment pair


MAX_LAYER_KINDS = 8  # layer kinds a plan may hold: each is a schedule of its own
MAX_LAYERS_OF_A_KIND = 100_000
LAYER_KIND_NAME = r"[A-Za-z_][A-Za-z0-9_.-]{0,63}"  # e.g. HF's "full_attention", "sliding_attention"


class BatchSpec(BaseModel):
    """A batch: an ordered list of sequence lengths, one mask for all of them or one a sequence; or layer kinds,
    each with its own mask for every sequence (one placement for all, one schedule a kind)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mask: Mask = Field(Mask(kind=MaskKind.CAUSAL), description="causal: token t sees 0..t of its sequence; full: all "
                       "of it; {\"kind\": \"sliding_window\", \"window\": W}: t - W + 1 .. t")
    masks: list[Mask] | None = Field(None, description="one mask a sequence, in batch order (instead of mask)")
    sequences: list[int] = Field(..., description="token length of each sequence, in batch order", min_length=1)
    layers: dict[str, Mask] | None = Field(
        None, description="layer kinds by name, each with its mask for every sequence (instead of mask and masks): "
        "the plan holds one schedule a kind over one placement, e.g. {\"full_attention\": \"causal\", "
        "\"sliding_attention\": {\"kind\": \"sliding_window\", \"window\": 128}}")
    layer_mix: dict[str, Annotated[int, Field(strict=True)]] | None = Field(
        None, description="how many layers of each kind the model has, by the names in layers (default: the "
        "model preset's): the placement is chosen by the time of this mix")

    @model_validator(mode="after")
    def _one_mask_a_sequence(self) -> "BatchSpec":
        if self.masks is not None and "mask" in self.model_fields_set:
            raise ValueError("give either 'mask' (one for every sequence) or 'masks' (one a sequence), not both")
        if self.layers is not None:
            if self.masks is not None or "mask" in self.model_fields_set:
                raise ValueError("give either 'layers' (a mask for each layer kind) or 'mask'/'masks', not both")
            check_layer_kinds(self.layers)
        if self.layer_mix is not None:
            if self.layers is None:
                raise ValueError("'layer_mix' counts the layers of each kind named in 'layers'; give 'layers' too")
            check_layer_mix(self.layer_mix, self.layers)
        if self.masks is not None and len(self.masks) != len(self.sequences):
            raise ValueError(f"masks holds {len(self.masks)} masks for {len(self.sequences)} sequences; give one a "
                             f"sequence, or one 'mask' for all")
        return self

    def windows(self) -> list[int]:
        """Per sequence, the keys a query sees back, itself included (0: every key, a full mask)."""
        masks = self.masks if self.masks is not None else [self.mask] * len(self.sequences)
        return [mask.window_for(length) for mask, length in zip(masks, self.sequences)]

    @field_validator("sequences", mode="before")
    @classmethod
    def _lengths_are_positive_integers(cls, value: object) -> object:
        if not isinstance(value, list):
            raise ValueError(f"sequences must be a list of positive integers, got {type(value).__name__}")
        if not value:
            raise ValueError("sequences is empty; a batch needs at least one sequence")
        if len(value) > MAX_SEQUENCES:
            raise ValueError(too_many_sequences(len(value)))
        for seq_idx, length in enumerate(value):
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ValueError(f"sequence {seq_idx} has length {shown(length)}; lengths must be positive integers")
        total = sum(value)
        if total > MAX_BATCH_TOKENS:
            raise ValueError(f"the batch holds {total} tokens, more than {MAX_BATCH_TOKENS} (a plan's arrays are "
                             f"int32)")
        return value


class AttentionShape(BaseModel):
    """Head counts, head size and wire dtype of the attention being planned."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_heads: int = Field(64, ge=1, le=4096, description="query heads")
    kv_heads: int = Field(8, ge=1, le=4096, description="key/value heads; divides q_heads")
    head_dim: int = Field(128, ge=1, le=4096, description="size of one head")
    dtype: DType = Field(DType.BF16, description="element type of Q, K, V, O")

    @model_validator(mode="after")
    def _gqa(self) -> "AttentionShape":
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token."""
        return 2 * self.kv_heads * self.head_dim * self.dtype.num_bytes

    @property
    def q_bytes_per_token(self) -> int:
        """Bytes of Q (or of a partial output) of one token."""
        return self.q_heads * self.head_dim * self.dtype.num_bytes


MIN_EFFICIENCY = 1e-3  # the least fraction of peak a tile may reach in a profile
MIN_RATE = 1e-3  # the least TFLOP/s or GB/s a profile may state


class EfficiencyPoint(BaseModel):
    """One point of the tile-efficiency curve: fraction of peak reached by a square tile of `tokens`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    tokens: Annotated[int, Field(ge=1)]
    # A floor, not just > 0: the simulator divides by it, and a tile under 0.1% of peak is a broken measurement.
    efficiency: Annotated[float, Field(ge=MIN_EFFICIENCY, le=1.0)]


class HardwareProfile(BaseModel):
    """What the cost model needs to know about one GPU and its network."""

    # Strict: a number given as a string ("8") is refused, not converted.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    name: str = Field(..., min_length=1)
    # Floors rather than > 0: the simulator divides by each, and anything below is not hardware.
    peak_tflops: float = Field(..., ge=MIN_RATE, description="dense bf16 tensor-core peak, TFLOP/s (>= 0.001)")
    network_gbps: float = Field(..., ge=MIN_RATE, description="per-GPU network bandwidth across nodes, GB/s per "
                                                               "direction (>= 0.001)")
    nvlink_gbps: float = Field(..., ge=MIN_RATE, description="per-GPU NVLink bandwidth inside a node, GB/s per "
                                                              "direction (>= 0.001)")
    hbm_gbps: float = Field(3350.0, ge=MIN_RATE, description="device memory (HBM) bandwidth, GB/s: what the runtime's "
                                                           "data movement outside the kernels is charged (>= 0.001)")
    gpus_per_node: int = Field(8, ge=1, description="GPUs a node holds (NVLink inside, a NIC each across)")
    latency_us: float = Field(10.0, ge=0, description="per-message latency, microseconds")
    launch_us: float = Field(5.0, ge=0, description="fixed cost of launching one stage's kernels, microseconds")
    comm_sm_fraction: float = Field(0.05, ge=0, lt=1, description="fraction of SMs given to communication kernels")
    efficiency_curve: list[EfficiencyPoint] = Field(..., min_length=1)
    source: str = Field("", description="where the figures come from")

    @field_validator("efficiency_curve")
    @classmethod
    def _curve_sorted(cls, points: list[EfficiencyPoint]) -> list[EfficiencyPoint]:
        tokens = [point.tokens for point in points]
        if tokens != sorted(set(tokens)):
            raise ValueError(f"efficiency_curve tokens must be strictly increasing, got {tokens}")
        return points


# Tile efficiency versus tile size, after the shape of the seed's Figure 3 (flash-attn on Hopper, 64 query heads,
# 8 KV heads, head_dim 128): tiles under 2K tokens fall steeply (512 tokens: about 25% of peak), 4K and above saturate.
# The absolute level is flash-attn 3's public forward figure (about 75% of dense peak on H100).
_HOPPER_CURVE = [(128, 0.07), (256, 0.14), (512, 0.25), (1024, 0.43), (2048, 0.62), (4096, 0.73), (8192, 0.76),
                 (16384, 0.77)]
_AMPERE_CURVE = [(128, 0.10), (256, 0.19), (512, 0.33), (1024, 0.50), (2048, 0.63), (4096, 0.70), (8192, 0.72),
                 (16384, 0.73)]
_BLACKWELL_CURVE = [(128, 0.05), (256, 0.10), (512, 0.19), (1024, 0.35), (2048, 0.55), (4096, 0.68),
                    (8192, 0.73), (16384, 0.75)]


def _curve(points: list[tuple[int, float]]) -> list[EfficiencyPoint]:
    return [EfficiencyPoint(tokens=tokens, efficiency=efficiency) for tokens, efficiency in points]


PRESET_PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile(
        name="h100", peak_tflops=989.0, network_gbps=50.0, nvlink_gbps=450.0, hbm_gbps=3350.0, gpus_per_node=8,
        latency_us=10.0, comm_sm_fraction=6 / 132, efficiency_curve=_curve(_HOPPER_CURVE),
        source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 4 900 GB/s (450 per "
               "direction); ConnectX-7 400 Gb/s InfiniBand = 50 GB/s per GPU; 6 of 132 SMs for communication "
               "(seed, GPU-X)"),
    "h200": HardwareProfile(
        name="h200", peak_tflops=989.0, network_gbps=50.0, nvlink_gbps=450.0, hbm_gbps=4800.0, gpus_per_node=8,
        latency_us=10.0, comm_sm_fraction=8 / 132, efficiency_curve=_curve(_HOPPER_CURVE),
        source="NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, NVLink 900 GB/s; "
               "ConnectX-7 400 Gb/s = 50 GB/s per GPU; 8 of 132 SMs for communication (seed, GPU-Y)"),
    "a100": HardwareProfile(
        name="a100", peak_tflops=312.0, network_gbps=25.0, nvlink_gbps=300.0, hbm_gbps=2039.0, gpus_per_node=8,
        latency_us=10.0, comm_sm_fraction=6 / 108, efficiency_curve=_curve(_AMPERE_CURVE),
        source="NVIDIA A100 SXM datasheet: 312 TFLOP/s dense BF16, 2.04 TB/s HBM2e (80 GB), NVLink 3 600 GB/s (300 "
               "per direction); HDR 200 Gb/s InfiniBand = 25 GB/s per GPU"),
    "b200": HardwareProfile(
        name="b200", peak_tflops=2250.0, network_gbps=50.0, nvlink_gbps=900.0, hbm_gbps=8000.0, gpus_per_node=8,
        latency_us=8.0, comm_sm_fraction=8 / 148, efficiency_curve=_curve(_BLACKWELL_CURVE),
        source="NVIDIA DGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU, 8 TB/s HBM3e, NVLink 5 1.8 TB/s (900 "
               "per direction); ConnectX-7 400 Gb/s = 50 GB/s per GPU"),
    # The seed's two anonymous GPUs, by the compute/network ratios of its Table 1 (BF16 tensor throughput over
    # network bandwidth): 5920 and 2500 FLOP per byte. Peaks are assumed (a Hopper- and a Blackwell-class GPU);
    # the network bandwidth follows from the ratio.
    "seed-x": HardwareProfile(
        name="seed-x", peak_tflops=989.0, network_gbps=989.0 / 5.920, nvlink_gbps=450.0, hbm_gbps=3350.0,
        gpus_per_node=8, latency_us=10.0, comm_sm_fraction=6 / 132, efficiency_curve=_curve(_HOPPER_CURVE),
        source="seed Table 1 GPU-X: 5920 FLOP/byte; 989 TFLOP/s assumed (Hopper class), so 167 GB/s per GPU; "
               "6 SMs for communication (seed)"),
    "seed-y": HardwareProfile(
        name="seed-y", peak_tflops=2250.0, network_gbps=2250.0 / 2.500, nvlink_gbps=900.0, hbm_gbps=8000.0,
        gpus_per_node=8, latency_us=8.0, comm_sm_fraction=8 / 148, efficiency_curve=_curve(_BLACKWELL_CURVE),
        source="seed Table 1 GPU-Y: 2500 FLOP/byte; 2.25 PFLOP/s assumed (Blackwell class), so 900 GB/s per GPU; "
               "8 SMs for communication (seed)"),
}


def _first_error(error: ValidationError) -> str:
    detail = error.errors()[0]
    where = clipped(".".join(str(part) for part in detail["loc"]) or "value")
    message = detail["msg"].removeprefix("Value error, ")
    got = repr(detail.get("input"))
    return f"{where}: {message} (got {got})" if "got" not in message and len(got) < 60 else f"{where}: {message}"


def _read_json(path: Path, what: str) -> object:
    return parse_json(read_input_text(path, what), f"{what} file {shown(str(path))}")


def parse_mask(value: object, what: str = "--mask") -> Mask:
    """A mask from its name (``causal``, ``full``), ``sliding_window:W`` or a Mask / its JSON object.

    `what` names the value in a message: ``--mask`` reads ``--mask 'bogus': ...``; one ending in ``=``
    (``--layer-masks a=``) takes the value right after it, ``--layer-masks a='bogus': ...``.

    Raises:
        InvalidInputError: naming the value and what would be valid.
    """
    if isinstance(value, Mask):
        return value
    given = f"{what}{'' if what.endswith('=') else ' '}{shown(value)}"  # the value as a message names it
    if isinstance(value, str) and value.startswith(f"{MaskKind.SLIDING_WINDOW.value}:"):
        window = value.split(":", 1)[1]
        if not re.fullmatch(r"[0-9]{1,10}", window):  # ASCII digits only: str.isdigit() also takes superscripts
            raise InvalidInputError(f"{given}: the window must be a positive integer, e.g. "
                                    f"sliding_window:4096")
        value = {"kind": MaskKind.SLIDING_WINDOW.value, "window": int(window)}
    try:
        return Mask.model_validate(value)
    except ValidationError as error:
        reason = error.errors()[0]["msg"].removeprefix("Value error, ")
        raise InvalidInputError(f"{given}: {reason}; valid: causal, full or sliding_window:W "
                                f"(W >= 1)") from None


def parse_shape(value: dict) -> AttentionShape:
    """An attention shape from its JSON form ({"q_heads", "kv_heads", "head_dim", "dtype"}).

    Raises:
        InvalidInputError: naming the value and the first bad field.
    """
    try:
        return AttentionShape.model_validate(value)
    except ValidationError as error:
        raise InvalidInputError(f"shape {shown(value)}: {_first_error(error)}") from None


def check_layer_kinds(layers: dict) -> None:
    """Layer kinds by name, each with a mask: 1 to MAX_LAYER_KINDS names of LAYER_KIND_NAME's form, no two with one
    mask (a kind is a schedule; two kinds of one mask are one kind).

    Raises:
        ValueError: naming the first bad name or the repeated mask.
    """
    if not 1 <= len(layers) <= MAX_LAYER_KINDS:
        raise ValueError(f"layers names {len(layers)} kinds; give 1 to {MAX_LAYER_KINDS}")
    seen: dict[Mask, str] = {}
    for name, mask in layers.items():
        _check_kind_name(name)
        if mask in seen:
            raise ValueError(f"layer kinds {shown(seen[mask])} and {shown(name)} have one mask; give it one kind")
        seen[mask] = name


def _check_kind_name(name: object) -> None:
    """Raise ValueError unless `name` is a layer kind's name (LAYER_KIND_NAME)."""
    if not isinstance(name, str) or not re.fullmatch(LAYER_KIND_NAME, name):
        raise ValueError(f"layer kind name {shown(name)} must be a letter or _ then up to 63 letters, digits, "
                         f"'_', '.' or '-' (e.g. full_attention)")


def check_layer_mix(layer_mix: dict, layers: dict) -> None:
    """A layer count for every kind and no other name, each 0 to MAX_LAYERS_OF_A_KIND, not all 0.

    Raises:
        ValueError: naming the first bad name or count.
    """
    if set(layer_mix) != set(layers):
        missing, unknown = sorted(set(layers) - set(layer_mix)), sorted(set(layer_mix) - set(layers))
        raise ValueError(f"the layer mix names {_names(layer_mix)} but the layer kinds are {_names(layers)}"
                         + (f": {shown(missing[0])} has no count" if missing else f": {shown(unknown[0])} is no kind"))
    for name, count in layer_mix.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_LAYERS_OF_A_KIND:
            raise ValueError(f"layer mix {clipped(str(name))}={shown(count)} must be a layer count from 0 to "
                             f"{MAX_LAYERS_OF_A_KIND}")
    if not any(layer_mix.values()):
        raise ValueError("every count of the layer mix is 0; a model has at least one layer")


def _names(names: object) -> str:
    """Names as a message lists them: sorted, each quoted and cut, at most MAX_LAYER_KINDS of them."""
    names = sorted(names, key=str)
    more = f", ... ({len(names):,} names)" if len(names) > MAX_LAYER_KINDS else ""
    return f"[{', '.join(shown(name, 24) for name in names[:MAX_LAYER_KINDS])}{more}]"


def _named_pairs(value: str, what: str, example: str) -> list[tuple[str, str]]:
    """NAME=VALUE,... split into pairs; a bad form is refused with one line."""
    pairs = []
    for part in value.split(","):
        name, equals, item = part.strip().partition("=")
        if not equals or not name.strip() or not item.strip():
            raise InvalidInputError(f"{what} {shown(value)}: each entry must be NAME=VALUE, e.g. {example}")
        pairs.append((name.strip(), item.strip()))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        repeated = next(name for name in names if names.count(name) > 1)
        raise InvalidInputError(f"{what} {shown(value)}: kind {shown(repeated)} is named twice")
    return pairs


def parse_layer_masks(value: object, what: str = "--layer-masks") -> dict[str, Mask]:
    """Layer kinds from ``NAME=MASK,...`` (a mask as :func:`parse_mask` takes it: causal, full,
    sliding_window:W) or a dict of names to masks.

    Raises:
        InvalidInputError: naming the value and what would be valid.
    """
    example = "full_attention=causal,sliding_attention=sliding_window:128"
    if isinstance(value, str):
        value = dict(_named_pairs(value, what, example))  # each mask parsed below
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} {shown(value)}: give NAME=MASK,... e.g. {example}")
    layers = {name: parse_mask(mask, f"{what} {clipped(str(name))}=") for name, mask in value.items()}
    try:
        check_layer_kinds(layers)
    except ValueError as error:
        raise InvalidInputError(f"{what}: {error}") from None
    return layers


def parse_layer_mix(value: object, what: str = "--layer-mix") -> dict[str, int]:
    """Layer counts from ``NAME=COUNT,...`` or a dict of names to counts (checked against the kinds later).

    Raises:
        InvalidInputError: naming the value and what would be valid.
    """
    example = "full_attention=18,sliding_attention=18"
    if isinstance(value, str):
        pairs = _named_pairs(value, what, example)
        _check_mix_names([name for name, _ in pairs], what, example)
        for name, count in pairs:
            if not re.fullmatch(r"[0-9]{1,6}", count):
                raise InvalidInputError(f"{what} {clipped(name)}={shown(count)}: a layer count must be an integer "
                                        f"from 0 to {MAX_LAYERS_OF_A_KIND}, e.g. {example}")
        value = {name: int(count) for name, count in pairs}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} {shown(value)}: give NAME=COUNT,... e.g. {example}")
    _check_mix_names(list(value), what, example)
    return dict(value)


def _check_mix_names(names: list, what: str, example: str) -> None:
    """A layer mix names 1 to MAX_LAYER_KINDS layer kinds (whether they are the batch's is checked later): no more,
    and none that is no kind's name, can match.

    Raises:
        InvalidInputError: naming the count or the first bad name.
    """
    if not 1 <= len(names) <= MAX_LAYER_KINDS:
        raise InvalidInputError(f"{what} names {len(names):,} layer kinds; give 1 to {MAX_LAYER_KINDS}, e.g. "
                                f"{example}")
    for name in names:
        try:
            _check_kind_name(name)
        except ValueError as error:
            raise InvalidInputError(f"{what}: {error}") from None


def too_many_sequences(num_sequences: int) -> str:
    """Why a batch of this many sequences is refused, before anything is allocated per sequence."""
    return (f"the batch holds {num_sequences:,} sequences, more than the {MAX_SEQUENCES:,} a plan may hold (each is "
            f"at least one segment pair for fcp validate to check)")


def parse_batch(data: object, origin: str = "batch") -> BatchSpec:
    """Validate a decoded batch: ``{"mask": ..., "sequences": [...]}`` or a bare list of lengths (causal).

    Raises:
        InvalidInputError: naming the first bad value.
    """
    if isinstance(data, list):  # causal: the default mask, not one the batch gives (layer kinds may give theirs)
        data = {"sequences": data}
    if not isinstance(data, dict):
        raise InvalidInputError(f"{origin}: expected an object with 'sequences' or a list of lengths, "
                                f"got {type(data).__name__}")
    try:
        return BatchSpec.model_validate(data)
    except ValidationError as error:
        raise InvalidInputError(f"{origin}: {_first_error(error)}") from None


def load_batch(path: str | Path) -> BatchSpec:
    """Read and validate a batch JSON file.

    Raises:
        InvalidInputError: missing file, bad JSON, or a bad length (named).
    """
    return parse_batch(_read_json(Path(path), "batch"), origin=str(path))


def load_profile(name_or_path: str) -> HardwareProfile:
    """Return a preset profile by name, or read a profile JSON file.

    Raises:
        InvalidInputError: unknown preset, missing or unreadable file (a name too long for a path one), or a bad
            field (named).
    """
    if name_or_path in PRESET_PROFILES:
        return PRESET_PROFILES[name_or_path]
    valid = f"presets are {', '.join(sorted(PRESET_PROFILES))}, or give a readable profile JSON file"
    path = Path(name_or_path)
    try:  # a name too long for a path (stat says so) or with a NUL (no path has one) is no file
        exists = "\0" not in name_or_path and path.exists()
    except OSError as error:
        raise InvalidInputError(f"hardware profile {shown(name_or_path)} is no preset and cannot be read as a file "
                                f"({error.strerror}); {valid}") from None
    if not exists:
        raise InvalidInputError(f"profile file {shown(name_or_path)} does not exist; {valid}" if path.suffix else
                                f"unknown hardware profile {shown(name_or_path)}; {valid}")
    data = _read_json(path, "profile")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as error:
        raise InvalidInputError(f"profile {shown(name_or_path)}: {_first_error(error)}") from None


def make_shape(q_heads: int, kv_heads: int, head_dim: int, dtype: str) -> AttentionShape:
    """Build an attention shape from CLI flags.

    Raises:
        InvalidInputError: naming the bad flag value.
    """
    try:
        return AttentionShape(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    except ValidationError as error:
        raise InvalidInputError(f"attention shape: {_first_error(error)}") from None
