"""Model-level measurements: `python -m kvcc.bench.embeddings` (sentence
embedding fidelity on all-MiniLM-L6-v2) and `python -m kvcc.bench.decode`
(decode speed of a Llama-architecture model)."""
