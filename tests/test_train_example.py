"""examples/train_tiny_llama.py trained under fcp on forked gloo ranks equals the same training in one process.

World 4, three AdamW steps, a new long-tail batch (and plan) every step, fp32: per-step losses within 1e-5
relative and final weights within 1e-5 of the single-process reference, in both layouts, with sliding windows, and
across a checkpoint. Each mistake a loop can make under fcp (RoPE positions off by a row or counted per rank,
labels in the wrong row order, a per-rank loss mean) is injected and must break the parity.

The weights are the tighter check: Adam divides each gradient element by its own running magnitude, so an element
whose gradient is nearly zero turns the ranks' different summation order into up to lr of difference. At the
example's lr the largest difference measured is 2.9e-6 (wv), a third of the tolerance.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fcp_runtime import recording  # noqa: E402
from runtime_harness import run_ranks  # noqa: E402

_PATH = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_llama.py"
_SPEC = importlib.util.spec_from_file_location("train_tiny_llama", _PATH)
example = importlib.util.module_from_spec(_SPEC)
sys.modules["train_tiny_llama"] = example
_SPEC.loader.exec_module(example)

WORLD = 4
# "plan" uses FCP's own placement, whose rows leave batch order, so that a label or position mistake shows; the
# floor may keep an equal-chunk placement that happens to keep a rank's rows in order.
CONFIGS = {"plan": example.Config(floor=False), "user": example.Config(layout="user"),
           "windows": example.Config(windows=True)}
_REFERENCES: dict = {}


def _reference(name: str) -> dict:
    if name not in _REFERENCES:
        _REFERENCES[name] = example.train_reference(CONFIGS[name])
    return _REFERENCES[name]


def _train(config, **kwargs) -> list[dict]:
    return run_ranks(WORLD, lambda rank, world: example.train_rank(config, **kwargs), timeout=300)


def _assert_parity(ranks: list[dict], reference: dict, steps=slice(None)) -> None:
    want = np.asarray(reference["losses"][steps])
    for result in ranks:
        np.testing.assert_allclose(result["losses"], want, rtol=1e-5, atol=0)
        for name, value in reference["state"].items():
            torch.testing.assert_close(torch.from_numpy(result["state"][name]), torch.from_numpy(value),
                                       rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_under_fcp_matches_one_process_step_by_step(name):
    config = CONFIGS[name]
    ranks = _train(config)
    assert all(len(result["losses"]) == config.num_steps for result in ranks)
    _assert_parity(ranks, _reference(name))
    if name == "plan":  # the plan layout really moves tokens away from the user layout's even chunks
        batch = example.PlanningCollate(0, WORLD, block_size=config.block_size, floor=config.floor)(
            example.documents(config, 0))
        assert not torch.equal(batch["rows"], torch.arange(config.tokens_per_step // WORLD))


def test_resuming_from_a_checkpoint_in_new_processes_continues_exactly(tmp_path):
    config, checkpoint = CONFIGS["plan"], tmp_path / "step2.pt"
    first = _train(config, save_after=2, checkpoint=checkpoint)
    assert [len(result["losses"]) for result in first] == [2] * WORLD and checkpoint.exists()
    resumed = _train(config, resume=checkpoint)  # new processes; plans recompiled from the step's batch
    assert all(len(result["losses"]) == 1 for result in resumed)
    uninterrupted = _train(config)
    for after, full in zip(resumed, uninterrupted):
        assert after["losses"] == full["losses"][2:]
        for name, value in full["state"].items():
            np.testing.assert_array_equal(after["state"][name], value, err_msg=name)
    _assert_parity(resumed, _reference("plan"), steps=slice(2, None))


def _positions_shifted(batch):
    # Off by one row: each token gets its predecessor's position. (Adding 1 to every position would not be a
    # mistake: RoPE scores depend on the difference of positions only.)
    return torch.roll(batch["position_ids"], 1)


def _positions_of_the_rank(batch):
    # Counted along the rank's own rows instead of inside each document.
    return torch.arange(batch["position_ids"].shape[0])


def _labels_in_batch_order(batch):
    # The labels of this rank's rows, but in the order of the concatenated batch instead of the plan's rows.
    return batch["labels"][torch.argsort(batch["token_index"])]


def _loss_mean_per_rank(logits, labels, num_batch_labels, group):
    # Each rank's mean, averaged over the ranks: what a data-parallel habit gives.
    per_rank = torch.nn.functional.cross_entropy(logits, labels, ignore_index=example.IGNORE)
    return per_rank / torch.distributed.get_world_size(group)


@pytest.mark.parametrize("attribute, fault", [("rank_positions", _positions_shifted),
                                              ("rank_positions", _positions_of_the_rank),
                                              ("rank_labels", _labels_in_batch_order)])
def test_positions_or_labels_that_are_not_the_plans_rows_are_refused(monkeypatch, attribute, fault):
    # The loop gives attention the positions it gives RoPE (as it must with a collate's plan) and the labels its
    # loss reads: wrong ones are refused on every rank before the first message, not trained on.
    monkeypatch.setattr(example, attribute, fault)  # the forked ranks inherit it
    with pytest.raises(AssertionError, match="BatchMismatchError: the model's position_ids or labels are not those"):
        _train(CONFIGS["plan"])


@pytest.mark.parametrize("attribute, fault", [("rank_loss", _loss_mean_per_rank)])
def test_each_mistake_a_training_loop_can_make_breaks_the_parity(monkeypatch, attribute, fault):
    monkeypatch.setattr(example, attribute, fault)  # the forked ranks inherit it
    ranks = _train(CONFIGS["plan"])
    with pytest.raises(AssertionError):
        _assert_parity(ranks, _reference("plan"))
    # Not a rounding-level miss: the first step's loss or the weights it produces are off by far more.
    assert max(abs(r["losses"][0] / _reference("plan")["losses"][0] - 1) for r in ranks) > 1e-4 or \
        max(np.abs(ranks[0]["state"][n] - v).max() for n, v in _reference("plan")["state"].items()) > 1e-3


def test_the_example_ends_with_a_verdict_line(capsys):
    fcp = [{"losses": [5.0, 4.0], "tokens_per_second": [1.0, 1.0]}]
    assert example._print_table(fcp, {"losses": [5.0, 4.0000001]})
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: MATCH: 2 steps")
    assert not example._print_table(fcp, {"losses": [5.0, 4.1]})
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: MISMATCH")


class _Recomputed(torch.nn.Module):
    """A block whose forward runs again in the backward (non-reentrant activation checkpointing)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, position_ids, attend):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, position_ids, attend, use_reentrant=False)


def _gradients(recompute: bool, prefetch: bool) -> dict:
    config = example.Config(num_layers=3)

    def task(rank, world):
        model, _ = example.build(config, torch.device("cpu"))
        if recompute:
            model.blocks = torch.nn.ModuleList(_Recomputed(block) for block in model.blocks)
        collate = example.PlanningCollate(rank, world, block_size=config.block_size)
        batch = collate(example.documents(config, 0))
        if prefetch:  # K,V prefetch forward (prefetch_kv) and backward (backward_starts_at)
            attend = example.FcpAttention(batch["plan"], None, batch["position_ids"], batch["labels"])
        else:
            attend = lambda q, k, v: example.fcp_attn_func(q, k, v, batch["plan"],  # noqa: E731
                                                           position_ids=batch["position_ids"])
        count = torch.tensor(float(sum((doc["labels"] != example.IGNORE).sum() for doc in
                                       example.documents(config, 0))))
        with recording() as events:
            logits = model(batch["tokens"], batch["position_ids"], attend)
            example.rank_loss(logits, batch["labels"], count, None).backward()
        example.sum_gradients(model, None)
        grads = {name.replace("block.", ""): p.grad.numpy().copy() for name, p in model.named_parameters()}
        prefetches = {name: sum(1 for e in events if e[:2] == ("prefetch", name)) for name in ("fwd", "bwd")}
        return grads, prefetches

    return run_ranks(2, task, timeout=300)[0]


@pytest.mark.parametrize("prefetch", [False, True])
def test_recomputed_layers_give_the_unchecked_gradients_with_and_without_prefetch(prefetch):
    """Under recomputation the forward's prefetch runs in both forwards; the backward's early pulls are skipped
    (posted once, with the rest of their stage), never posted for an attention call that will not take them."""
    plain, plain_prefetches = _gradients(recompute=False, prefetch=prefetch)
    recomputed, recomputed_prefetches = _gradients(recompute=True, prefetch=prefetch)
    layers = 3 if prefetch else 0
    assert plain_prefetches == {"fwd": layers, "bwd": layers}
    assert recomputed_prefetches == {"fwd": 2 * layers, "bwd": 0}
    assert set(plain) == set(recomputed)
    for name, grad in plain.items():
        np.testing.assert_allclose(recomputed[name], grad, rtol=0, atol=1e-6, err_msg=name)
    assert max(float(np.abs(g).max()) for g in plain.values()) > 1e-3
