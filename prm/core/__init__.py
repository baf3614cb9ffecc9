"""The copyable reference: data, model, LoRA, packed attention, metrics, evaluation, devices.
Imports nothing of prm outside this folder; each module but evaluate copies alone."""
