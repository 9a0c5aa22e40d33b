"""What ``torchrun`` tells a process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), read and checked in one place."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from retr.common.errors import UserError


@dataclass(frozen=True)
class TorchrunEnv:
    """A process's rank, the world size, and its local rank (for ``cuda:N``); one process by default."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "TorchrunEnv":
        """Read the environment (``os.environ`` by default); malformed values are a one-line :class:`UserError`."""
        env = os.environ if environ is None else environ
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError:
            raise UserError("RANK / WORLD_SIZE / LOCAL_RANK in the environment are not integers") from None
        if not 0 <= rank < max(world, 1):
            raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank, max(world, 1), local)
