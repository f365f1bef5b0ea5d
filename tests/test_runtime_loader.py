import pytest

torch = pytest.importorskip("torch")

from fcp_runtime.loader import PlanningCollate  # noqa: E402


def test_collate_in_dataloader_workers_gives_each_rank_its_slice_of_one_plan():
    documents = [torch.arange(n) for n in (700, 3000, 90, 1200)]
    slices, digests = [], set()
    for rank in range(4):
        loader = torch.utils.data.DataLoader(documents, batch_size=4, num_workers=1,
                                             collate_fn=PlanningCollate(rank, 4, block_size=512),
                                             multiprocessing_context="fork")
        (batch,) = list(loader)
        assert batch["plan"].rank == rank and batch["plan"].user_tokens == batch["tokens"].shape[0]
        digests.add(batch["plan"].digest)
        slices.append(batch["tokens"])
    assert len(digests) == 1  # every rank compiled the same plan
    assert torch.equal(torch.cat(slices), torch.cat(documents))
