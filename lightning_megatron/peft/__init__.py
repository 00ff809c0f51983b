"""Parameter-efficient fine-tuning: LoRA adapters attached by module-name pattern (``peft.lora``), split by the
tensor-parallel plan consistently with the layers they adapt (``peft.plan``). ``peft.adapters`` holds what
checkpoints and the models need to know about attached adapters, and declares their initial values to
``parallel.initialize``; whether a name is an adapter's is ``parallel.names.is_adapter_name``, in the base layer,
so that initialisation, FP8 and the optimizer ask it without importing this package (this package imports nothing
at import)."""
