"""ds4py: a minimal inference engine for DeepSeek V4 Flash.

Importing the package is cheap and never touches CUDA: the GPU backend is loaded only when asked for.
"""

__version__ = "0.1.0"
