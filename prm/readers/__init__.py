"""Reading data: files and splits (sources), formats, tokenizing (ingest), the offline task
(synthetic)."""
