"""What ft writes for other tools from a trained model: GGUF files for llama.cpp and Ollama (gguf.py)."""
