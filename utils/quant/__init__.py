"""Lab 08's family: GGUF files (reading, a random-weight model, a planted fault) and llama.cpp's engines and backends."""
