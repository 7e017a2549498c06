"""A Runtime-shaped launcher over the CPU emulator for the kernel tests: `rt.launch(name, grid, block, *args,
smem=, stream=, pdl=)` runs the kernel from whichever cu/ file defines it, on numpy arrays (updated in place),
in the thread order given at construction. Streams and PDL are accepted and ignored (launches are synchronous)."""

from __future__ import annotations

from typing import Any

from ds4py.cuda import emu


class EmuLaunch:
    def __init__(self, *stems: str, order: str = "forward", seed: int = 0):
        self.modules = [emu.load(emu.CU_DIR / f"{s}.cu") for s in stems]
        self.order, self.seed = order, seed
        self.launches: list[str] = []

    def launch(self, name: str, grid: Any, block: Any, *args: Any, smem: int = 0, stream: Any = None,
               pdl: bool = False) -> None:
        for m in self.modules:
            if name in m.kernels:
                self.launches.append(name)
                m.launch(name, grid, block, list(args), shared_mem=smem, order=self.order, seed=self.seed)
                return
        raise KeyError(f"no loaded kernel file defines {name}")
