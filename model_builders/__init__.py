"""Policy models made offline: the embedded tiny default (`default_model`) and SmolLM2 from PyPI's GGUF
(`smollm2`). Imports only the common ground."""
