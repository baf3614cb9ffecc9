"""Reading data: the checked JSON reader and splits (sources), the formats the field ships (formats), tokenizing a
dataset (ingest), the offline default task (synthetic) and `python -m prm.convert`."""
