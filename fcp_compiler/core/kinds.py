"""Layer kinds: a model whose layers differ in mask (a sliding window here, full causal there) over one placement.

The tokens' layout is shared by every kind, so there is one dispatch; each kind has a schedule of its own, which
pulls only the blocks its mask reads. The kinds come from the batch (`layers`) or the options (`--layer-masks`);
how many layers each has from the options (`--layer-mix`), the batch (`layer_mix`) or the model preset, in that
order. The placement is scheduled for the kind with the most attention work in the model (the primary) and chosen
by the time of the whole mix (:mod:`fcp_compiler.core.floor` scores each candidate so).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.core.ir import Batch
from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.inputs import Mask, check_layer_mix
from fcp_compiler.format.models import ModelPreset


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerKind:
    """One layer kind: its name, its mask (every sequence's), its layer count in the model, and the batch its
    passes read (the lengths, this kind's windows, and the pairing windows every kind shares)."""

    name: str
    mask: Mask
    num_layers: int
    batch: Batch


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerKinds:
    """The kinds of a compile, in the order given; `primary_idx` the one the placement is scheduled for."""

    kinds: tuple[LayerKind, ...]
    primary_idx: int

    @property
    def primary(self) -> LayerKind:
        return self.kinds[self.primary_idx]

    @property
    def others(self) -> tuple[LayerKind, ...]:
        """Every kind but the primary, in order."""
        return tuple(kind for idx, kind in enumerate(self.kinds) if idx != self.primary_idx)

    def weight(self, kind: LayerKind) -> float:
        """Layers of `kind` per layer of the primary: how much its time counts in the primary's score."""
        return kind.num_layers / self.primary.num_layers

    def canonical(self) -> list:
        """What the inputs digest records of the kinds: names, masks and counts, in order."""
        return [[kind.name, kind.mask.model_dump(mode="json"), kind.num_layers] for kind in self.kinds]


def pairing_windows(lengths: np.ndarray, kind_windows: list[np.ndarray]) -> np.ndarray:
    """Per sequence, the window that decides zig-zag pairing for a layout every kind shares: the narrowest of the
    kinds' (a full mask counts as the whole sequence). A sequence is paired only where every kind's mask pays for
    it (passes.shard.pairs_chunks), since a block that pairs chunks from both ends of a sequence makes a window
    read keys at both ends."""
    return np.min([np.where(windows == 0, lengths, windows) for windows in kind_windows], axis=0).astype(np.int64)


def layer_kinds(lengths: np.ndarray, layers: dict | None, spec_mix: dict | None, layer_masks: tuple | None,
                layer_mix: tuple | None, model: ModelPreset | None) -> LayerKinds | None:
    """The compile's layer kinds, or None for a batch of one kind.

    Args:
        lengths: the batch's sequence lengths (int64).
        layers, spec_mix: the batch's `layers` and `layer_mix` (None where it gives none).
        layer_masks, layer_mix: the options' overrides ((name, value), ...), or None.
        model: the model preset, whose `layer_mix` counts kinds of its names.
    Returns:
        LayerKinds with every kind's batch; the primary is the kind with the most attention work over the model's
        layers (its visible token pairs times its layer count; the first on a tie).
    Raises:
        InvalidInputError: kinds with no mix (naming what would give one), or a mix that does not match them.
    """
    masks = dict(layer_masks) if layer_masks is not None else layers
    if masks is None:
        if layer_mix is not None:
            raise InvalidInputError(f"--layer-mix {_shown(layer_mix)} counts layer kinds, but the batch names none: "
                                    f"give the kinds' masks (--layer-masks NAME=MASK,... or the batch's 'layers')")
        return None
    mix = _mix_of(masks, layer_mix, spec_mix, model)
    windows = [np.array([mask.window_for(int(length)) for length in lengths], dtype=np.int64)
               for mask in masks.values()]
    shared = pairing_windows(lengths, windows)
    kinds = tuple(LayerKind(name=name, mask=mask, num_layers=mix[name],
                            batch=Batch(lengths=lengths, windows=kind_windows, pairing_windows=shared))
                  for (name, mask), kind_windows in zip(masks.items(), windows))
    work = [kind.num_layers * float(visible_pairs(0, lengths, 0, lengths, kind.batch.windows).sum())
            for kind in kinds]
    return LayerKinds(kinds=kinds, primary_idx=int(np.argmax(work)))


def _mix_of(masks: dict, layer_mix: tuple | None, spec_mix: dict | None, model: ModelPreset | None) -> dict:
    """Each kind's layer count: the options', the batch's, or the model preset's where it names these kinds."""
    if layer_mix is not None:
        mix, origin = dict(layer_mix), f"--layer-mix {_shown(layer_mix)}"
    elif spec_mix is not None:
        mix, origin = spec_mix, "the batch's layer_mix"
    elif model is not None and model.layer_mix and set(dict(model.layer_mix)) == set(masks):
        mix, origin = dict(model.layer_mix), f"model {model.name}"
    else:
        named = f" (model {model.name} counts {', '.join(dict(model.layer_mix))})" if model and model.layer_mix \
            else ""
        raise InvalidInputError(f"layer kinds {', '.join(masks)} have no layer mix{named}: give --layer-mix "
                                f"{','.join(f'{name}=COUNT' for name in masks)} (or the batch's 'layer_mix')")
    try:
        check_layer_mix(mix, masks)
    except ValueError as error:
        raise InvalidInputError(f"{origin}: {error}") from None
    return mix


def _shown(pairs: tuple) -> str:
    return ",".join(f"{name}={value}" for name, value in pairs)
