"""L1 recurrent-state pool: per recurrent layer, a convolution state and a delta-rule state per slot."""
from __future__ import annotations

import torch


class RecurrentStatePool:
    """The `StatePool` of a model with recurrent layers (tiers/base.py), on the compute device.

    conv[layer]: [num_slots, *conv_shape] in the model dtype (the convolution's last inputs);
    ssm[layer]: [num_slots, *ssm_shape] float32 (the recurrence's matrices), for each of
    `num_layers` recurrent layers. The runner's model reads and writes them through a batch's slots.
    """

    def __init__(self, num_slots: int, num_layers: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str):
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.conv = [torch.zeros((num_slots, *conv_shape), dtype=dtype, device=device) for _ in range(num_layers)]
        self.ssm = [torch.zeros((num_slots, *ssm_shape), dtype=torch.float32, device=device) for _ in range(num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: low slots first

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        for buf in self.conv + self.ssm:
            buf[dst].copy_(buf[src])

    def clear(self, slot: int) -> None:
        for buf in self.conv + self.ssm:
            buf[slot].zero_()

    def num_free(self) -> int:
        return len(self._free)

    def capacity(self) -> int:
        return self.num_slots

    def free_slots(self) -> list[int]:
        return list(self._free)

    @staticmethod
    def slot_bytes(num_layers: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...],
                   dtype: torch.dtype) -> int:
        """Bytes of one slot of a pool of these shapes."""
        conv = torch.Size(conv_shape).numel() * torch.empty((), dtype=dtype).element_size()
        return num_layers * (conv + torch.Size(ssm_shape).numel() * 4)
