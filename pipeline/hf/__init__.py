"""Hugging Face interop: streaming safetensors I/O, state-dict conversion per family, export and import."""
