// Emulator stand-in: cuda_emu.h (force-included) already defines what this header provides.
#pragma once
