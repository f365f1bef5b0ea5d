"""The context-parallel group from a DeviceMesh: one helper for every integration (Hugging Face, the trainers,
torchtitan), so that none imports another's framework to find it."""

from __future__ import annotations

CP_DIM = "cp"  # the mesh dimension fcp's context parallelism runs over


def cp_group(group_or_mesh, hint: str = "e.g. init_device_mesh(device, (dp, cp), mesh_dim_names=('dp', 'cp'))"):
    """The context-parallel process group of a DeviceMesh (its "cp" dimension), or the group itself (None: the
    world).

    Args:
        group_or_mesh: a process group, a DeviceMesh with a "cp" dimension, or None.
        hint: how the caller's framework builds such a mesh, for the error.
    Raises:
        ValueError: a mesh without a "cp" dimension, naming its dimensions.
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group_or_mesh, DeviceMesh):
        return group_or_mesh
    names = group_or_mesh.mesh_dim_names or ()
    if CP_DIM not in names:
        raise ValueError(f"the device mesh has dimensions {tuple(names)}; fcp needs one named {CP_DIM!r} ({hint})")
    return group_or_mesh.get_group(CP_DIM)
