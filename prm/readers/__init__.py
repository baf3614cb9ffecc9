"""Reading data: sources, formats, tokenizing (ingest), the offline task (synthetic)."""
