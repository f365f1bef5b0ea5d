"""CompileOptions: every parameter of a compile besides the batch, checked once at the boundary."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fcp_compiler.core.baselines import OWN_BLOCK_SIZE, Planner
from fcp_compiler.core.ir import ZigzagMode
from fcp_compiler.errors import InvalidInputError, shown
from fcp_compiler.format.inputs import (MAX_BATCH_TOKENS, PRESET_PROFILES, AttentionShape, HardwareProfile, Layout,
                                        Mask, load_profile, parse_layer_masks, parse_layer_mix, parse_mask,
                                        parse_shape)
from fcp_compiler.format.models import DEFAULT_MODEL, MODEL_PRESETS, NO_MODEL, ModelPreset, load_model
from fcp_compiler.format.plan_format import MAX_BLOCK_SIZE, MAX_COALESCE, MAX_RANKS

_NONE_IS_A_VALUE = frozenset({"block_size", "token_cap", "token_tolerance", "mask", "model", "node_fan_out",
                              "memory_budget_gib"})
DEFAULT_BLOCK_SIZE = 4096  # the seed's evaluation
# The device memory a rank's attention may peak at in either pass, by default, with a model: what Llama-3-70B leaves
# of an 80 GB H100 at 256 GPUs and 32K tokens a GPU (the seed's setting), once the rest of training has its share:
# model states under ZeRO-3 (16 bytes a parameter / 256: 4.4 GB), the checkpointed layer inputs (80 x 32K x 8192 x
# 2 bytes: 42.9 GB), one layer's recompute and backward working set (34 bytes x 32K x 8192: 9.1 GB, Korthikanti et
# al.), the gathered and prefetched layer parameters and the gradient bucket (3 x 1.8 GB), CUDA context, NCCL and
# allocator slack (about 10%: 8 GB), and the loss over a chunk of the 128K vocabulary in fp32 (about 4 GB) leave about
# 6 GB; 4 GiB of it for attention keeps a margin for fragmentation. Attention alone (no model) has no default budget.
DEFAULT_MEMORY_BUDGET_GIB = 4.0
MAX_MEMORY_BUDGET_GIB = 2.0**20
# With a model in the plan layout, tokens a rank holds are linear-layer time: ranks keep within 5% of the mean tokens
# where whole blocks allow. On nine real-distribution batches at 64 and 256 GPUs (benchmarks/layer_objective.py
# --fcp-options token_tolerance=T) the cap alone (mean + one block) leaves ranks 11% above the mean tokens and the
# layer waits for them; 0.5%, 1% and 2% gave summed layer makespans within 1.3% of each other, 1% the least (before
# the floor and the device budget). FCP's own placement alone (`--no-floor`, 4 GiB) on the 54 matrix batches, at 3%,
# 5%, 7% and 10% against 1%: 0.31%, 0.45%, 0.35% faster and 0.26% slower (geometric means); at 5% within 0.5% of the
# floor on 37 (30 at 1%), within 2% on 46 (43), worst 1.047 (1.080). The floor tries 1%, 5% and 10% whatever this is.
LAYER_TOKEN_TOLERANCE = 0.05
# Node fan-out as each system ships: MagiAttention 1.1 has hierarchical (node-level) group collectives, a chunk sent
# once to each destination node and forwarded over NVLink; the ring, ByteScale and WLB-LLM send point to point.
NODE_FAN_OUT_DEFAULT = {Planner.FCP: True, Planner.MAGI: True, Planner.RING: False, Planner.BYTESCALE: False,
                        Planner.WLBLLM: False}


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """Every parameter of a compile besides the batch; the defaults are the seed's setting.

    Build one with :meth:`of` from user-facing values (names of presets and enums as strings, with a one-line
    error for a bad one), pass it to :func:`fcp_compiler.core.pipeline.compile_plan`, bulk compile, compare,
    sweep and ablation, and derive variants with :meth:`replace`.
    """

    num_ranks: int
    block_size: int | None = None  # None: DEFAULT_BLOCK_SIZE, or the baseline's own sizing (ring, bytescale, wlbllm)
    coalesce: int = 16  # rounds a forward stage (the backward's stages hold twice as many)
    token_cap: int | None = None  # None: mean tokens per rank + one block
    # Relative excess over the mean tokens a rank may hold, where whole blocks allow (None: LAYER_TOKEN_TOLERANCE
    # with a model in the plan layout, the cap alone otherwise). In the plan layout every other layer works on a
    # rank's own tokens; tighter token balance costs attention traffic.
    token_tolerance: float | None = None
    zigzag: ZigzagMode = ZigzagMode.AUTO
    layout: Layout = Layout.PLAN
    shape: AttentionShape = field(default_factory=AttentionShape)
    profile: HardwareProfile = field(default_factory=lambda: PRESET_PROFILES["h100"])
    mask: Mask | None = None  # overrides the batch's own mask (or masks)
    # The layer around attention whose per-rank time (linear layers on a rank's tokens, plus its attention) the
    # placement balances; None: attention alone.
    model: ModelPreset | None = field(default_factory=lambda: MODEL_PRESETS[DEFAULT_MODEL])
    planner: Planner = Planner.FCP
    # GPUs a node holds (NVLink inside, a NIC each across); None: the profile's. Recorded in the plan's profile.
    gpus_per_node: int | None = None
    # Ablations of the seed's techniques (docs/DESIGN.md section 7); the defaults are the full system.
    pipelined: bool = True
    matching_rounds: bool = True
    reshuffle_overlap: bool = True
    # The runtime projects K and V first and posts the forward's stage-0 K,V pulls (fcp_runtime.prefetch_kv) while
    # Q is projected, and the backward's as the layer's backward starts; the schedule is scored so (plan layout
    # only: the user layout reshuffles first).
    kv_prefetch: bool = True
    # A K,V block crosses into a node once and fans out over NVLink; None: as each planner ships
    # (NODE_FAN_OUT_DEFAULT). FCP's floor also tries its placements with it off.
    node_fan_out: bool | None = None
    # FCP schedules its candidate placements (core/floor.py) and keeps the fastest; False: its own placement only
    # (scheduled and finished as the floor's first candidate).
    floor: bool = True
    # Refuse a plan with more segment pairs than the validator enumerates (algorithms/limits.py), before sharding
    # where the lengths alone show it; False lets a tool score a ring baseline over hundreds of GPUs unvalidated.
    validatable: bool = True
    # Schedule a baseline's placement within the floor's live-buffer budget (4 x coalesce x block size tokens,
    # smaller stages where needed) and the default memory budget, so that planners compare at equal memory (FCP's
    # own placement with the floor off is always scheduled so, as the floor's first candidate).
    fit_memory: bool = False
    # The most device memory (GiB) a rank's attention may peak at in either pass (fcp_compiler.format.memory): the
    # stages are made smaller until every rank fits, and a budget no schedule meets is refused. None: the default,
    # DEFAULT_MEMORY_BUDGET_GIB for FCP with a model (none for attention alone, and none for a baseline, which
    # compiles as its system ships, unless fit_memory holds it to FCP's memory), met where scheduling can meet it
    # (a rank with several times the seed's tokens cannot: the default is the seed's setting's, not a refusal);
    # math.inf: no budget.
    memory_budget_gib: float | None = None
    # Layer kinds, each a mask for every sequence, overriding the batch's own (`layers`): ((name, Mask), ...).
    layer_masks: tuple[tuple[str, Mask], ...] | None = None
    # Layers of each kind, overriding the batch's `layer_mix` and the model preset's: ((name, count), ...).
    layer_mix: tuple[tuple[str, int], ...] | None = None

    @property
    def resolved_memory_budget_bytes(self) -> int | None:
        """The memory budget in bytes, or None for none."""
        budget = self.memory_budget_gib
        if budget is None:  # a baseline held to FCP's memory (fit_memory) is held to its budget too
            default = self.model is not None and (self.planner is Planner.FCP or self.fit_memory)
            budget = DEFAULT_MEMORY_BUDGET_GIB if default else math.inf
        return None if math.isinf(budget) else int(budget * 2**30)

    @property
    def memory_budget_is_strict(self) -> bool:
        """Whether a plan over the memory budget is refused (a budget the user gave) rather than kept over it (the
        default, where no schedule meets it)."""
        return self.memory_budget_gib is not None

    @classmethod
    def of(cls, num_ranks: int, **fields) -> CompileOptions:
        """Options from user-facing values: enums by name, the profile by preset name or file, shape None for
        the default; every field checked.

        Raises:
            InvalidInputError: an unknown field, or a value out of range (named, with what would be valid).
        """
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InvalidInputError(f"unknown compile option {shown(unknown[0])}; valid: "
                                    f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        # None means "the default" for the fields whose default is not None itself.
        fields = {name: value for name, value in fields.items() if value is not None or name in _NONE_IS_A_VALUE}
        for name, kind, what in (("zigzag", ZigzagMode, "zigzag"), ("layout", Layout, "layout"),
                                 ("planner", Planner, "planner")):
            if fields.get(name) is not None:
                fields[name] = _enum(kind, fields[name], what)
        if fields.get("mask") is not None:
            fields["mask"] = parse_mask(fields["mask"])
        if isinstance(fields.get("shape"), dict):  # the JSON form, as schemas/attention_shape.v1.json gives it
            fields["shape"] = parse_shape(fields["shape"])
        if fields.get("layer_masks") is not None:
            fields["layer_masks"] = tuple(parse_layer_masks(dict(fields["layer_masks"])
                                                            if not isinstance(fields["layer_masks"], str)
                                                            else fields["layer_masks"]).items())
        if fields.get("layer_mix") is not None:
            fields["layer_mix"] = tuple(parse_layer_mix(dict(fields["layer_mix"])
                                                        if not isinstance(fields["layer_mix"], str)
                                                        else fields["layer_mix"]).items())
        if isinstance(fields.get("model"), str):
            fields["model"] = load_model(fields["model"])
        if isinstance(fields.get("profile"), str):
            fields["profile"] = load_profile(fields["profile"])
        options = cls(num_ranks=num_ranks, **fields)
        options.check()
        if options.gpus_per_node is not None and options.gpus_per_node != options.profile.gpus_per_node:
            profile = options.profile.model_copy(update={"gpus_per_node": options.gpus_per_node})
            options = dataclasses.replace(options, profile=profile)
        return options

    def replace(self, **changes) -> CompileOptions:
        """A copy with `changes` applied and checked (the same values :meth:`of` takes)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return CompileOptions.of(**{**current, **changes})

    @property
    def resolved_token_tolerance(self) -> float | None:
        """The token tolerance the placement keeps: the given one, else LAYER_TOKEN_TOLERANCE where the linear
        layers run on a rank's own tokens (a model in the plan layout), else none."""
        if self.token_tolerance is not None:
            return self.token_tolerance
        return LAYER_TOKEN_TOLERANCE if self.model is not None and self.layout is Layout.PLAN else None

    @property
    def resolved_node_fan_out(self) -> bool:
        """Whether K,V blocks fan out inside nodes: the given switch, else the planner's own default; FCP's own
        placement alone (the floor off) goes direct, as the floor's first candidate does: the floor keeps a direct
        plan on 50 of the 54 matrix batches, and alone with fan-out the placement stayed over the 4 GiB device
        budget on 13 of them, direct on none (benchmarks/loss_modes.py)."""
        if self.node_fan_out is not None:
            return self.node_fan_out
        return False if self.planner is Planner.FCP and not self.floor else NODE_FAN_OUT_DEFAULT[self.planner]

    @property
    def resolved_kv_prefetch(self) -> bool:
        """Whether the plan is scheduled for a runtime that prefetches the first stage's K,V: the switch, in the plan
        layout (the user layout's attention reshuffles its inputs first)."""
        return self.kv_prefetch and self.layout is Layout.PLAN

    @property
    def model_name(self) -> str:
        """The model preset's name, or "none"."""
        return self.model.name if self.model is not None else NO_MODEL

    @property
    def resolved_block_size(self) -> int:
        """The block size the passes use (a baseline that sizes its own blocks ignores it)."""
        return DEFAULT_BLOCK_SIZE if self.block_size is None else self.block_size

    def check(self) -> None:
        """Raise InvalidInputError naming the first parameter out of range."""
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or \
                not 1 <= self.num_ranks <= MAX_RANKS:
            raise InvalidInputError(f"--gpus {shown(self.num_ranks)} must be an integer from 1 to {MAX_RANKS}")
        block_size = self.block_size
        if block_size is not None and self.planner in OWN_BLOCK_SIZE:
            raise InvalidInputError(f"--block-size {shown(block_size)} does not apply to --planner "
                                    f"{self.planner.value}: it shards each sequence over ranks and sizes its blocks "
                                    f"itself; leave --block-size out")
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                       or not 64 <= block_size <= MAX_BLOCK_SIZE or block_size % 64):
            raise InvalidInputError(f"--block-size {shown(block_size)} must be a multiple of 64 from 64 to "
                                    f"{MAX_BLOCK_SIZE} (e.g. 1024, 2048, 4096)")
        if isinstance(self.coalesce, bool) or not isinstance(self.coalesce, int) or \
                not 1 <= self.coalesce <= MAX_COALESCE:
            raise InvalidInputError(f"--coalesce {shown(self.coalesce)} must be an integer from 1 to {MAX_COALESCE}")
        if self.token_cap is not None and (not isinstance(self.token_cap, int) or
                                           not 1 <= self.token_cap <= MAX_BATCH_TOKENS):
            raise InvalidInputError(f"--token-cap {shown(self.token_cap)} must be an integer from 1 to "
                                    f"{MAX_BATCH_TOKENS}")
        if self.gpus_per_node is not None and (isinstance(self.gpus_per_node, bool) or
                                               not isinstance(self.gpus_per_node, int) or
                                               not 1 <= self.gpus_per_node <= MAX_RANKS):
            raise InvalidInputError(f"--gpus-per-node {shown(self.gpus_per_node)} must be an integer from 1 to "
                                    f"{MAX_RANKS} (8 on an HGX node)")
        if self.node_fan_out is not None and not isinstance(self.node_fan_out, bool):
            raise InvalidInputError(f"--node-fan-out {shown(self.node_fan_out)} must be on or off")
        for name in ("pipelined", "matching_rounds", "reshuffle_overlap", "kv_prefetch", "floor", "validatable",
                     "fit_memory"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} {shown(getattr(self, name))} must be True or False")
        budget = self.memory_budget_gib
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or
                                   not (0.0 < budget <= MAX_MEMORY_BUDGET_GIB or budget == math.inf)):
            raise InvalidInputError(f"--memory-budget {shown(budget)} must be a number of GiB in (0, "
                                    f"{MAX_MEMORY_BUDGET_GIB:g}], e.g. 4, or none")
        if self.token_tolerance is not None and (
                isinstance(self.token_tolerance, bool) or not isinstance(self.token_tolerance, (int, float))
                or not 0.0 < self.token_tolerance < 1.0):
            raise InvalidInputError(f"--token-tolerance {shown(self.token_tolerance)} must be a number in (0, 1), "
                                    f"e.g. 0.02")


def _enum(kind, value, what: str):
    try:
        return kind(value)
    except ValueError:
        raise InvalidInputError(f"{what} {shown(value)} must be one of "
                                f"{', '.join(member.value for member in kind)}") from None
