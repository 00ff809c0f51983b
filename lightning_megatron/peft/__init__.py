"""Parameter-efficient fine-tuning: LoRA adapters attached by module-name pattern (``peft.lora``), split by the
tensor-parallel plan consistently with the layers they adapt (``peft.plan``). ``peft.adapters`` holds what the rest
of the package needs to know about adapters by name (this package imports nothing at import, so that those low
modules can read it without a circle)."""
