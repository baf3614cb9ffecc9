"""Reading data: JSON and splits (sources), the formats (formats), tokenizing (ingest), the
offline default task (synthetic)."""
