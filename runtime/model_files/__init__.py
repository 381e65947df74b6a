"""Model folders: HF config, weight loading, GGUF conversion, tokenizer writer, model cache, default model, demo."""
