"""Stand-ins for the torch.distributed process groups megatron-core's modules take, where a CPU
case runs one rank: the modules read the group's size and rank, nothing else."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelSize:
    """Stands in for the TP process group: the module reads only its size."""

    world_size: int
    rank_index: int = 0

    def size(self) -> int:
        return self.world_size

    def rank(self) -> int:
        return self.rank_index
