"""Output: results written as Parquet (one file or shards), resume state, OpenAI Batch lines."""
