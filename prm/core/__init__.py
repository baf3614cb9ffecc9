"""The copyable reference: tokenizing and batching, the model and its loss, LoRA, packed attention, metrics, the
evaluation route and the device plumbing. Imports nothing of prm outside this folder; data, model, lora, varlen,
metrics and runtime each copy into another repo alone."""
