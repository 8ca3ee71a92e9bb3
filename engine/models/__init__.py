"""Models for the engine: loading an mlx-lm model with its page geometry (load), the
default models kvtier provides (defaults), GGUF import (gguf), and where kvtier keeps
its files (paths)."""
