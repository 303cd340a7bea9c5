"""What ft makes of a trained run for other tools: GGUF files for llama.cpp and Ollama (gguf.py), pushes to the hub
(push.py)."""
